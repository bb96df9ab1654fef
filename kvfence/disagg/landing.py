"""The landing process: a worker's NIXL agent, out of the worker's process, sharing only its area.

UCX authenticates nobody, and over TCP it checks neither who asks nor that an address lies in registered
memory: a process that reaches an agent's listener can read and write that agent's whole address space,
and crash it with a read of an unmapped address. So no agent lives in a worker. `LandingAgent` starts a
separate process per worker that maps one shared area (decode: landing slots; prefill: send slots; a
sealed page each, see kvfence/disagg/seal.py), registers it and answers the worker's calls over a pipe.

Contract:
- The only memory the two processes share is the area. A stray write through UCX hits the landing
  process, never the engine; what it holds of tenants' KV is sealed (AES-GCM), so a read learns nothing.
- The process drops root (to nobody) once its agent is up, and its UCX listens only on the interface of
  the worker's own address (`UCX_NET_DEVICES`), not on every interface of the host. It stays dumpable, so
  two landing processes of one host keep cross-memory attach (another `nobody` process could read it:
  sealed areas only).
- If it dies, the worker goes on serving: a call in flight fails (`poll` answers ERR, so the transfer
  fails closed), and the process is started again over the same area, with the peers it had re-added
  and a new `incarnation` (decode announces the new agent before its next grant).
- `LandingAgent` answers the `OneSidedAgent` calls (kvfence/disagg/nixl_transport.py), so the workers
  cannot tell it from an agent in their own process (which tests use).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import socket
import struct
import subprocess
import sys
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from kvfence.disagg.nixl_transport import AreaLayout, NixlAgent, Write
from kvfence.disagg.seal import SEAL

NOBODY = 65534
_PR_SET_DUMPABLE = 4
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


class LandingLost(RuntimeError):
    """The landing process is gone (crashed or killed); it is being started again."""


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


class LandingAgent:
    """A `OneSidedAgent` whose NIXL agent runs in a landing process over a shared [slots, slot_bytes] area."""

    def __init__(self, name: str, slots: int, slot_bytes: int, interface: str | None) -> None:
        self.name, self.interface = name, interface
        self._shm = SharedMemory(create=True, size=slots * slot_bytes)
        self.area = np.ndarray((slots, slot_bytes), dtype=np.uint8, buffer=self._shm.buf)
        self.area[:] = 0
        self._peers: dict[str, bytes] = {}  # re-added to a restarted process
        self.incarnation = -1
        self.restarts = 0
        self._start()

    def _start(self) -> None:
        """A fresh interpreter (not a multiprocessing child: a worker may itself be a daemonic process),
        talking over a socket pair; it ends when its end of the pair closes."""
        ours, theirs = socket.socketpair()
        env = {**os.environ, **({"UCX_NET_DEVICES": self.interface} if self.interface else {})}
        slots, slot_bytes = self.area.shape
        argv = [sys.executable, "-m", "kvfence.disagg.landing", self.name, self._shm.name]
        argv += [str(slots), str(slot_bytes), str(theirs.fileno())]
        self._process = subprocess.Popen(argv, pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self._conn = Connection(ours.detach())
        base, slots, slot_bytes = self._call("layout")
        self.layout = AreaLayout(base, slots, slot_bytes)  # the area as the landing process maps it
        for metadata in self._peers.values():
            self._call("add_peer", metadata)
        self.incarnation += 1

    def _call(self, op: str, *args: Any) -> Any:
        try:
            self._conn.send((op, args))
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            self._restart()
            raise LandingLost(f"the landing process of {self.name} died during {op}") from exc
        if status != "ok":
            raise RuntimeError(f"landing process: {op}: {value}")
        return value

    def _restart(self) -> None:
        self._conn.close()
        self._stop(timeout_s=1)
        self.restarts += 1
        self._start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def _stop(self, timeout_s: float) -> None:
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def describe(self) -> dict[str, Any]:
        """What the data plane trusts, for the console and /v1/audit/info."""
        return {
            "agent": "landing process",
            "pid": self.pid,
            "uid": self._call("uid"),
            "ucx_interface": self.interface or "every interface",
            "pool_registered": False,
            "seal": SEAL,
            "restarts": self.restarts,
        }

    def metadata(self) -> bytes:
        return bytes(self._call("metadata"))

    def add_peer(self, metadata: bytes) -> str:
        name = str(self._call("add_peer", metadata))
        self._peers[name] = metadata
        return name

    def remove_peer(self, name: str) -> None:
        self._peers.pop(name, None)
        self._call("remove_peer", name)

    def write(self, peer: str, remote: AreaLayout, pairs: list[tuple[int, int]], request_id: str) -> Write:
        try:
            handle = self._call(
                "write", peer, (remote.base, remote.slots, remote.slot_bytes), pairs, request_id
            )
        except LandingLost:
            return Write(peer, None, "ERR")
        return Write(peer, (self.incarnation, handle))

    def poll(self, write: Write) -> str:
        """PROC, DONE or ERR; a write of a process that has since died is ERR: it may or may not have
        landed, so its transfer fails closed."""
        if write.state == "PROC":
            incarnation, handle = write.handle
            try:
                write.state = "ERR" if incarnation != self.incarnation else self._call("poll", handle)
            except LandingLost:
                write.state = "ERR"
        return write.state

    def notified(self) -> list[str]:
        try:
            return [str(request_id) for request_id in self._call("notified")]
        except LandingLost:
            return []

    def close(self) -> None:
        with contextlib.suppress(LandingLost, RuntimeError):
            self._call("close")
        self._conn.close()
        self._stop(timeout_s=5)
        del self.area  # the last view of the buffer, before it is closed
        self._shm.close()
        self._shm.unlink()


def _serve(name: str, shm_name: str, shape: tuple[int, int], conn: Connection) -> None:
    """The landing process: map the area, register it, drop root, then answer calls until told to close
    or the worker is gone (its end of the pair closed)."""
    shm = SharedMemory(shm_name)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]  # the worker's to unlink
    area = np.ndarray(shape, dtype=np.uint8, buffer=shm.buf)
    agent = NixlAgent(name, area)
    _drop_root()
    writes: dict[int, Write] = {}
    calls = {
        "layout": lambda: (agent.layout.base, agent.layout.slots, agent.layout.slot_bytes),
        "metadata": agent.metadata,
        "add_peer": agent.add_peer,
        "remove_peer": agent.remove_peer,
        "write": lambda peer, remote, pairs, rid: _post(agent, writes, peer, AreaLayout(*remote), pairs, rid),
        "poll": lambda handle: agent.poll(writes[handle]) if handle in writes else "ERR",
        "notified": agent.notified,
        "uid": os.geteuid,
    }
    while True:
        try:
            op, args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "close":
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", calls[op](*args)))
        except Exception as exc:  # a bad call fails that call, never this process's loop
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    agent.close()


def _post(
    agent: NixlAgent, writes: dict[int, Write], peer: str, remote: AreaLayout, pairs: list, request_id: str
) -> int:
    write = agent.write(peer, remote, [(int(s), int(t)) for s, t in pairs], request_id)
    handle = len(writes)
    writes[handle] = write
    return handle


def _drop_root() -> None:
    """Root is needed for nothing once the agent is up: a landing process taken over through UCX then
    holds no privilege (it cannot read other processes' memory or files)."""
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        # Changing uid makes a process undumpable, which also bars cross-memory attach (how UCX moves
        # bytes between two processes of one host, 4x TCP's speed here) between two landing processes.
        # They hold only sealed areas, so being reachable by another `nobody` process costs no secret.
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)


if __name__ == "__main__":  # started by LandingAgent: NAME SHM SLOTS SLOT_BYTES FD
    _name, _shm, _slots, _slot_bytes, _fd = sys.argv[1:]
    _serve(_name, _shm, (int(_slots), int(_slot_bytes)), Connection(int(_fd)))
