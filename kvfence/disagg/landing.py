"""The landing process, seen from its worker: a worker's NIXL agent in another process, under another uid,
sharing nothing with the worker but one sealed area, and believed in nothing it says.

UCX authenticates nobody, and over TCP it checks neither who asks nor that an address lies in registered
memory: a process that reaches an agent's listener can read and write that agent's whole address space.
So no agent lives in a worker, and the process it lives in is hostile from its first frame.

Contract:
- The only memory the two processes share is the area (a memfd sealed against growing and shrinking, so
  the landing process cannot make the worker's mapping fault). What it holds of tenants' KV is sealed
  (AES-GCM, kvfence/disagg/seal.py): a read learns nothing, a write can only make a transfer fail.
- Who it runs as, what it inherits, and what is observed of it: kvfence/disagg/landing_identity.py (a uid
  of its own, not dumpable, an allow-listed environment, no core files). Its stdout and stderr go to a log
  file of its own (mode 0600, `describe()["log"]`). Its UCX listens only on the named interface.
- The pipe between them is a socket pair carrying kvfence/disagg/landing_wire.py's frames: every reply is
  parsed, typed and range-checked before use. Every call has a deadline of `deadline_s` of time the
  process could have run (`lifetime.Progress`: a process the scheduler starves is waited for, up to
  CALL_CAP_S; one stopped, asleep or spinning is not); a reply that is late, malformed or out of turn, or
  a process that is gone, makes the process be killed and started again (`LandingLost`): calls fail
  until the new one has answered START, which the worker's loop never waits for. A WRITE posted by an
  earlier process polls ERR: it may or may not have landed, so its transfer fails closed. `incarnation`
  counts the processes started; a worker fails every one-sided transfer of an earlier one.
- Restarts back off (`lifetime.Restarts`: at once, then 0.5 s doubling); past `RESTART_LIMIT` failures in a
  row the agent gives up (`given_up`, logged): no process is started again and every call fails, so its
  worker takes no one-sided KV. The process is killed when its worker ends (a parent-death signal).
- Only root can start one (`landing_identity.separation_refusal`); construction raises otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvfence.disagg import landing_wire as wire
from kvfence.disagg.landing_identity import landing_env, landing_uid, observe, separation_refusal
from kvfence.disagg.landing_wire import Notification, Op, WireError, WriteCall
from kvfence.disagg.nixl_transport import AreaLayout, Write
from kvfence.disagg.seal import SEAL
from kvfence.lifetime import Progress, Restarts, process_state

START_DEADLINE_S = 30.0  # a fresh interpreter importing NIXL and creating its agent (1-2 s here)
START_CAP_S = 120.0  # ...however starved it is
CALL_DEADLINE_S = 1.0  # any other call: a landing process that could have run this long is wedged
CALL_CAP_S = 30.0  # ...and one the scheduler starved this long, whatever it did
PATIENCE_POLL_S = 0.05  # past the nominal deadline, how often a starved process's progress is judged
RESTART_LIMIT = 5  # failures in a row before the agent gives up
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address

log = logging.getLogger("kvfence.disagg")


class LandingError(RuntimeError):
    """A call to the landing process failed: it refused it, or it is lost (`LandingLost`)."""


class LandingLost(LandingError):
    """The landing process is gone, wedged, starting, or said something that does not parse: it is being
    started again, and nothing it was doing is believed."""


def interface_of(host: str) -> str | None:
    """The network interface that holds `host`'s IPv4 address (`lo` for 127.0.0.1), or None (a wildcard
    address, or one no interface holds)."""
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(packed[20:24]) == address:
            return name
    return None


def _sealed_area(slots: int, slot_bytes: int) -> tuple[int, mmap.mmap]:
    """A zeroed memfd of `slots * slot_bytes`, sealed so that no holder can grow or shrink it."""
    fd = os.memfd_create("kvfence-landing-area", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, slots * slot_bytes)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    return fd, mmap.mmap(fd, slots * slot_bytes)


class LandingAgent:
    """A `OneSidedAgent` whose NIXL agent runs in a landing process over a shared [slots, slot_bytes] area."""

    program: tuple[str, ...] = ("-m", "kvfence.disagg.landing_process")  # FD SOCK SLOTS SLOT_BYTES UID CMA

    def __init__(
        self,
        name: str,
        slots: int,
        slot_bytes: int,
        interface: str | None,
        uid: int | None = None,
        log_dir: Path | None = None,
        deadline_s: float = CALL_DEADLINE_S,
        cma: bool = False,
    ) -> None:
        refusal = separation_refusal()
        if refusal is not None:
            raise RuntimeError(refusal)
        self.name, self.interface, self.deadline_s = name, interface, deadline_s
        if cma and uid is None:
            raise ValueError("cross-memory attach needs every landing process under one uid: name it")
        self.uid, self.cma = landing_uid(uid, os.getpid()), cma
        self._fd, self._map = _sealed_area(slots, slot_bytes)
        self.area = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, slot_bytes)
        self.log_path = self._log_file(log_dir or Path(tempfile.gettempdir()) / "kvfence-landing")
        self._peers: dict[str, bytes] = {}  # re-added to a restarted process
        self.incarnation, self.backoff = -1, Restarts(limit=RESTART_LIMIT)
        self._next_start: float | None = None  # while a restart waits out its backoff
        self.layout = AreaLayout(0, slots, slot_bytes)  # the landing process's own mapping, once started
        self._spawn()
        self._await_start()

    # ---- the process ---------------------------------------------------------------------------------------

    def _log_file(self, directory: Path) -> Path:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return directory / f"{self.name}.log"

    def _spawn(self) -> None:
        """A fresh interpreter (not a multiprocessing child: a worker may itself be a daemonic process),
        over a socket pair and the area's fd; it ends when its end of the pair closes."""
        self.agent_name = f"{self.name}-{secrets.token_hex(8)}"  # never in argv: sent in START
        ours, theirs = socket.socketpair()
        slots, slot_bytes = self.area.shape
        argv = [sys.executable, *self.program, str(self._fd), str(theirs.fileno())]
        argv += [str(slots), str(slot_bytes), str(self.uid), str(int(self.cma))]
        env = landing_env({"UCX_NET_DEVICES": self.interface} if self.interface else {}, self.cma)
        logfd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        try:
            self._process = subprocess.Popen(
                argv, pass_fds=(self._fd, theirs.fileno()), env=env, stdin=subprocess.DEVNULL,
                stdout=logfd, stderr=logfd, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(logfd)
            theirs.close()
        self._sock, self._seq, self._up, self._up_since, self._next_start = ours, 0, False, None, None
        self.incarnation += 1
        self._starting = Progress(self._process.pid, time.monotonic(), START_DEADLINE_S, START_CAP_S)
        self._send(Op.START, self.agent_name.encode())

    def _await_start(self) -> None:
        """At construction only (the worker is not serving yet): wait for the first process's START."""
        while not self._ready():
            if self._process.poll() is not None or self._starting.overdue(time.monotonic()):
                self._kill()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the landing process of {self.name} did not start; its log:\n{tail}")
            select.select([self._sock], [], [], 0.05)

    def _ready(self) -> bool:
        """Whether the current process has answered START; never waits for it. Its answer (the area's
        layout, nothing else) is checked, then the peers it had are re-added."""
        if self._up:
            return True
        if self._next_start is not None or self.given_up:
            return False
        if not select.select([self._sock], [], [], 0)[0]:
            if self._starting.overdue(time.monotonic()):
                self._lost("did not start in time")
            return False
        slots, slot_bytes = self.area.shape
        try:
            base = wire.parse_layout(self._reply(Op.START, time.monotonic()), slots, slot_bytes)
        except LandingError:
            return False
        self.layout, self._up, self._up_since = AreaLayout(base, slots, slot_bytes), True, time.monotonic()
        for metadata in self._peers.values():
            wire.parse_name(self._call(Op.ADD_PEER, metadata))
        return True

    def check(self) -> None:
        """From the worker's loop, never waiting: a process that exited or was stopped is replaced now
        (not at the next transfer, which would fail), a restart whose backoff is over starts, and a
        starting one's START answer is taken."""
        if self.given_up:
            return
        if self._next_start is not None:
            if time.monotonic() >= self._next_start:
                self._spawn()
            return
        state = process_state(self._process.pid) if self._process.poll() is None else "exited"
        try:
            if state in ("exited", "T", "t"):
                self._lost(f"its state is {state}")
            else:
                self._ready()
        except LandingError:
            pass  # lost again: another is starting

    def _lost(self, why: str) -> None:
        """Kill the process (stopped, wedged or lying: it is not asked to leave) and start another after
        the backoff (at once the first time), or give up."""
        pid = self.pid
        self._kill()
        self._up, now = False, time.monotonic()
        delay = self.backoff.failed(now, self._up_since)
        if delay is None:
            log.error(
                "landing process of %s (pid %s) lost: %s; %d failures in a row: given up, this worker "
                "takes no one-sided KV", self.name, pid, why, self.backoff.in_a_row,
            )  # fmt: skip
            return
        log.warning(
            "landing process of %s (pid %s) lost: %s; starting another in %.1f s (restart %d)",
            self.name, pid, why, delay, self.backoff.total,
        )  # fmt: skip
        if delay > 0:
            self._next_start = now + delay
        else:
            self._spawn()

    def _kill(self) -> None:
        self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(self.deadline_s)

    @property
    def serving(self) -> bool:
        """Whether the current process has answered START (calls can succeed); never waits."""
        return self._up

    @property
    def given_up(self) -> bool:
        """Past RESTART_LIMIT failures in a row: no process runs or will; every call fails."""
        return self.backoff.given_up

    @property
    def restarts(self) -> int:
        return self.backoff.total

    def _state_name(self) -> str:
        if self.given_up:
            return "given up"
        return "serving" if self._up else "starting" if self._next_start is None else "restarting"

    @property
    def pid(self) -> int | None:
        """The current process's, None while none runs (a restart waiting, or given up)."""
        return None if self._next_start is not None or self.given_up else self._process.pid

    # ---- the wire --------------------------------------------------------------------------------------

    def _send(self, op: Op, body: bytes) -> None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        try:
            self._sock.settimeout(self.deadline_s)
            self._sock.sendall(wire.frame(self._seq, op, body))
        except OSError as exc:
            self._lost(f"{op.name}: {exc}")
            raise LandingLost(f"the landing process of {self.name} is lost") from exc

    def _reply(self, op: Op, sent: float) -> bytes:
        """The reply to the call sent at `sent`, within the deadline; its header is checked before its body
        is read."""
        deadline = Progress(self._process.pid, sent, self.deadline_s, CALL_CAP_S)
        try:
            status, length = wire.parse_header(self._recv_exact(wire.HEADER.size, deadline), self._seq, op)
            body = self._recv_exact(length, deadline)
        except (OSError, EOFError, WireError) as exc:
            self._lost(f"{op.name}: {type(exc).__name__}: {exc}")
            raise LandingLost(f"the landing process of {self.name} is lost") from exc
        if status:
            raise LandingError(f"landing process: {op.name}: {wire.parse_error(body)}")
        return body

    def _recv_exact(self, n: int, deadline: Progress) -> bytes:
        """`n` bytes; the socket is read before the deadline is judged, so a reply that came while this
        process itself was starved is taken."""
        data = bytearray()
        while len(data) < n:
            self._sock.settimeout(max(deadline.start + deadline.budget_s - time.monotonic(), PATIENCE_POLL_S))
            try:
                chunk = self._sock.recv(n - len(data))
            except TimeoutError:
                if deadline.overdue(time.monotonic()):
                    raise TimeoutError("no answer in the time it could have run") from None
                continue
            if not chunk:
                raise EOFError("closed")
            data += chunk
        return bytes(data)

    def _call(self, op: Op, body: bytes = b"") -> bytes:
        if not self._ready():
            raise LandingLost(f"the landing process of {self.name} is {self._state_name()}")
        sent = time.monotonic()
        self._send(op, body)
        return self._reply(op, sent)

    def _checked(self, op: Op, body: bytes, parse: Any) -> Any:
        """A call whose reply `parse` must accept; one that does not is a lost landing process."""
        reply = self._call(op, body)
        try:
            return parse(reply)
        except WireError as exc:
            self._lost(f"{op.name}: {exc}")
            raise LandingLost(f"the landing process of {self.name} is lost") from exc

    # ---- OneSidedAgent ---------------------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        """What the data plane trusts, for the console and /v1/audit/info: each condition read from /proc."""
        conditions = observe(self.pid, self.uid) if self.pid else {}
        return {
            "agent": "landing process",
            "pid": self.pid,
            "uid": self.uid,
            "ucx_interface": self.interface or "every interface",
            "cross_memory_attach": self.cma,
            "pool_registered": False,
            "seal": SEAL,
            "restarts": self.restarts,
            "state": self._state_name(),
            "log": str(self.log_path),
            "conditions": {**conditions, "one_interface": self.interface is not None},
        }

    def metadata(self) -> bytes:
        return bytes(self._call(Op.METADATA))

    def add_peer(self, metadata: bytes) -> str:
        if len(metadata) > wire.MAX_METADATA:
            raise LandingError(f"a peer's metadata of {len(metadata)} bytes")
        name = self._checked(Op.ADD_PEER, metadata, wire.parse_name)
        self._peers[name] = metadata
        return name

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)
        self._checked(Op.REMOVE_PEER, name.encode(), wire.parse_empty)

    def write(self, peer: str, remote: AreaLayout, pairs: list[tuple[int, int]], request_id: str) -> Write:
        call = WriteCall(peer, (remote.base, remote.slots, remote.slot_bytes), pairs, request_id)
        try:
            handle = self._checked(Op.WRITE, wire.write_request(call), wire.parse_handle)
        except LandingError:
            return Write(peer, None, "ERR")
        return Write(peer, (self.incarnation, handle))

    def poll(self, write: Write) -> str:
        """PROC, DONE or ERR; a write of a process that has since been replaced is ERR: it may or may not
        have landed, so its transfer fails closed."""
        if write.state == "PROC":
            incarnation, handle = write.handle
            try:
                if incarnation != self.incarnation:
                    write.state = "ERR"
                else:
                    write.state = self._checked(Op.POLL, struct.pack(">I", handle), wire.parse_state)
            except LandingError:
                write.state = "ERR"
        return write.state

    def notified(self) -> list[Notification]:
        try:
            return self._checked(Op.NOTIFIED, b"", wire.parse_notified)
        except LandingError:
            return []

    def close(self) -> None:
        if self._up:
            with contextlib.suppress(LandingError):
                self._checked(Op.CLOSE, b"", wire.parse_empty)
        self._sock.close()
        try:
            self._process.wait(5)
        except subprocess.TimeoutExpired:
            self._kill()
        del self.area  # the last view of the mapping, before it is closed
        with contextlib.suppress(BufferError):  # a caller still holds a view: unmapped when it goes
            self._map.close()
        os.close(self._fd)
