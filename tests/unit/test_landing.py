"""The landing process: UCX out of the worker's process, under a uid of its own, on one interface, and
believed in nothing it says.

UCX authenticates nobody and over TCP checks no address against registered memory, so whoever reaches
it controls the landing process. Each protection is shown against its absence: an agent with no
interface named listens beyond loopback, an agent in the worker's process maps UCX into it, a dumpable
process of the same uid gives its secrets away, a reply that is a pickle would have run code.
"""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from kvfence.disagg import landing_identity
from kvfence.disagg.landing import LandingAgent, LandingLost, interface_of
from kvfence.disagg.landing_identity import NOBODY, separation_refusal
from kvfence.disagg.nixl_transport import AreaLayout, NixlAgent, new_area, nixl_available
from kvfence.lifetime import Restarts, sched_times

pytestmark = [
    pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed: no landing process"),
    pytest.mark.skipif(os.geteuid() != 0, reason="a landing process needs root to get a uid of its own"),
]
WAIT_S = 10.0
HOSTILE = Path(__file__).parent / "hostile_landing.py"


def listeners(pid: int) -> set[str]:
    """The local addresses process `pid` listens on (TCP)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return {line.split()[3].rpartition(":")[0] for line in out.splitlines() if f"pid={pid}," in line}


def wait_written(src: NixlAgent | LandingAgent, dst: LandingAgent, write: object) -> str:
    deadline = time.monotonic() + WAIT_S
    while (state := src.poll(write)) == "PROC":  # type: ignore[arg-type]
        dst.notified()
        assert time.monotonic() < deadline, "the WRITE did not finish"
    return state


def uids(pid: int) -> list[int]:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^Uid:\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)", status, flags=re.MULTILINE)
    assert found
    return [int(uid) for uid in found.groups()]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_ucx_listens_only_on_the_workers_interface() -> None:
    """Named `lo` (the interface of 127.0.0.1), the landing process listens there alone; with none named,
    UCX listens on every interface the host has (what the worker refuses to start: see test_launch)."""
    fenced, open_ = (
        LandingAgent("fenced", 4, 64, interface_of("127.0.0.1")),
        LandingAgent("open", 4, 64, None),
    )
    try:
        assert interface_of("127.0.0.1") == "lo" and fenced.pid is not None and open_.pid is not None
        assert listeners(fenced.pid) == {"127.0.0.1"}
        wide = listeners(open_.pid)
        assert wide and wide != {"127.0.0.1"}, wide
        assert open_.describe()["conditions"]["one_interface"] is False
    finally:
        fenced.close()
        open_.close()


def test_the_landing_process_runs_under_a_uid_of_its_own_and_inherits_no_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every uid of the process is its own (not root, nobody or the worker's), two workers' landing
    processes do not share one, /proc says it is not dumpable, and its environment holds the UCX setting
    it needs and none of the worker's secrets."""
    monkeypatch.setenv("KVFENCE_ADMIN_KEY", "admin-secret-123")
    monkeypatch.setenv("KVFENCE_API_KEYS", "key-a tenant-a")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    first, second = LandingAgent("first", 4, 64, "lo"), LandingAgent("second", 4, 64, "lo", uid=0x4B570001)
    try:
        assert first.pid is not None and second.pid is not None
        assert uids(first.pid) == [first.uid] * 4 and first.uid not in (0, NOBODY, os.geteuid())
        assert uids(second.pid) == [0x4B570001] * 4
        assert first.describe()["conditions"] == {
            "separate_uid": True,
            "not_dumpable": True,
            "one_interface": True,
        }
        environ = Path(f"/proc/{first.pid}/environ").read_bytes()  # as root: the landing process cannot
        assert b"UCX_NET_DEVICES=lo" in environ
        for secret in (b"admin-secret-123", b"key-a", b"sk-should-not-leak", b"KVFENCE_"):
            assert secret not in environ
        assert Path(f"/proc/{first.pid}/environ").stat().st_uid == 0  # the kernel's mark of not dumpable
        assert first.log_path.stat().st_mode & 0o077 == 0
    finally:
        first.close()
        second.close()


def test_a_landing_uid_that_is_not_its_own_is_refused() -> None:
    for uid in (0, NOBODY, os.geteuid()):
        with pytest.raises(ValueError, match="a uid of its own"):
            LandingAgent("shared", 4, 64, "lo", uid=uid)


def test_without_root_no_landing_process_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that is not root has no other uid to give it: refused, saying why and what to use."""
    monkeypatch.setattr(landing_identity.os, "geteuid", lambda: 1000)
    refusal = separation_refusal()
    assert refusal is not None and "--kv-transport zmq" in refusal
    with pytest.raises(RuntimeError, match="not root"):
        LandingAgent("unprivileged", 4, 64, "lo")


ATTACK = """
import ctypes, errno, os, sys
uid, target, fd = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
got = []
pidfd = libc.syscall(434, target, 0)  # pidfd_open
if pidfd >= 0 and libc.syscall(438, pidfd, fd, 0) >= 0:  # pidfd_getfd: the landing's end of the pipe
    got.append("pidfd_getfd")
if libc.ptrace(16, target, 0, 0) == 0:  # PTRACE_ATTACH
    got.append("ptrace"); libc.ptrace(17, target, 0, 0)
for name in ("mem", "environ"):  # opening /proc/PID/mem is the check (offset 0 is never mapped)
    try:
        with open(f"/proc/{target}/{name}", "rb") as opened:
            name == "environ" and opened.read(1)
        got.append(name)
    except OSError:
        pass
print(",".join(got) or "refused")
"""

VICTIM = """
import ctypes, os, socket, sys, time
uid = int(sys.argv[1])
held = socket.socketpair()
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # dumpable again: what the landing process used to do
print(held[0].fileno(), flush=True)
time.sleep(60)
"""


def attack(uid: int, pid: int, fd: int) -> str:
    """What a keyless process as `uid` gets of process `pid`: pidfd_getfd, ptrace, mem, environ."""
    run = subprocess.run(
        [sys.executable, "-c", ATTACK, str(uid), str(pid), str(fd)], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


def test_no_process_but_root_reaches_a_landing_process() -> None:
    """As nobody and as the landing process's own uid, a keyless process gets none of pidfd_getfd, ptrace,
    /proc/PID/mem or /proc/PID/environ on a landing process; the same process as that uid reads the
    environment of a dumpable process of that uid (the landing process before: the attack worked)."""
    agent = LandingAgent("target", 4, 64, "lo")
    victim = subprocess.Popen(
        [sys.executable, "-c", VICTIM, str(agent.uid)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout is not None
        victim_fd = int(victim.stdout.readline())
        assert attack(agent.uid, victim.pid, victim_fd) == "pidfd_getfd,ptrace,mem,environ"
        assert agent.pid is not None
        socket_fd = int(Path(f"/proc/{agent.pid}/cmdline").read_bytes().split(b"\0")[-6])  # public argv
        for uid in (NOBODY, agent.uid):
            assert attack(uid, agent.pid, socket_fd) == "refused"
    finally:
        victim.kill()
        victim.wait()
        agent.close()


def test_cross_memory_attach_is_opt_in_and_shares_a_uid_among_landing_processes_only() -> None:
    """--landing-cma: both landing processes under the one uid named, dumpable to it, UCX free to pick
    cross-memory attach; pages move. Its cost, shown: a process of that uid now reaches the other landing
    process (ptrace, mem, environ), while nobody still gets nothing; /proc says dumpable, so the plane is
    not reported sealed. Without a uid named, refused."""
    with pytest.raises(ValueError, match="one uid"):
        LandingAgent("unnamed", 4, 64, "lo", cma=True)
    uid = 0x4B550002
    sender = LandingAgent("cma-sender", 4, 64, "lo", uid=uid, cma=True)
    receiver = LandingAgent("cma-receiver", 4, 64, "lo", uid=uid, cma=True)
    try:
        assert sender.pid is not None and receiver.pid is not None
        assert uids(sender.pid) == uids(receiver.pid) == [uid] * 4
        assert b"UCX_TLS=^cma" not in Path(f"/proc/{sender.pid}/environ").read_bytes()
        sender.area[:] = 7
        write = sender.write(sender.add_peer(receiver.metadata()), receiver.layout, [(0, 2)], "r1")
        assert wait_written(sender, receiver, write) == "DONE" and (receiver.area[2] == 7).all()
        described = receiver.describe()
        assert described["cross_memory_attach"] is True
        assert described["conditions"] == {"separate_uid": True, "not_dumpable": False, "one_interface": True}
        socket_fd = int(Path(f"/proc/{receiver.pid}/cmdline").read_bytes().split(b"\0")[-6])
        assert attack(uid, receiver.pid, socket_fd) == "pidfd_getfd,ptrace,mem,environ"
        assert attack(NOBODY, receiver.pid, socket_fd) == "refused"
    finally:
        sender.close()
        receiver.close()


WORKER_MAPS = """
import sys
from kvfence.disagg.landing import LandingAgent
agent = LandingAgent("maps", 4, 64, "lo")
{extra}
maps = open("/proc/self/maps").read()
print("ucx" if "libucp" in maps or "libucs" in maps else "clean")
agent.close()
"""


def test_the_worker_process_maps_no_ucx() -> None:
    """The worker's own address space holds no UCX at all (so nothing reached through UCX is the
    engine's); an agent created in the worker's process, as before, maps it."""
    landing = subprocess.run(
        [sys.executable, "-c", WORKER_MAPS.format(extra="")], capture_output=True, text=True
    )
    assert landing.stdout.split()[-1:] == ["clean"], landing.stderr[-2000:]
    in_process = (
        "from kvfence.disagg.nixl_transport import NixlAgent, new_area\nNixlAgent('x', new_area(4, 64))"
    )
    before = subprocess.run(
        [sys.executable, "-c", WORKER_MAPS.format(extra=in_process)], capture_output=True, text=True
    )
    assert before.stdout.split()[-1:] == ["ucx"], before.stderr[-2000:]


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_stopped_landing_process_fails_its_write_and_is_replaced(how: signal.Signals) -> None:
    """Killed or stopped with a WRITE in flight: that WRITE is ERR (its transfer fails closed) once the
    call's deadline passes, the process is killed, and a new one serves the same area with its peers
    re-added; calls made while it starts fail at once instead of waiting for it."""
    sender, receiver = LandingAgent("sender", 4, 64, "lo"), LandingAgent("receiver", 4, 64, "lo")
    try:
        sender.area[:] = 9
        peer = sender.add_peer(receiver.metadata())
        write = sender.write(peer, receiver.layout, [(0, 1)], "r1")
        old = sender.pid
        assert old is not None
        os.kill(old, how)
        assert wait_written(sender, receiver, write) == "ERR"
        assert (sender.restarts, sender.incarnation) == (1, 1) and gone(old)
        deadline = time.monotonic() + WAIT_S
        while (again := sender.write(peer, receiver.layout, [(1, 2)], "r2")).state == "ERR":
            assert time.monotonic() < deadline, "no new landing process"  # starting: refused at once
        assert wait_written(sender, receiver, again) == "DONE"  # the re-added peer, the same area
        assert (receiver.area[2] == 9).all() and sender.pid != old
    finally:
        sender.close()
        receiver.close()


class HostileLanding(LandingAgent):
    """The real LandingAgent over tests/unit/hostile_landing.py in the mode given."""

    def __init__(self, mode: str) -> None:
        self.program = (str(HOSTILE), mode)
        super().__init__(f"hostile-{mode}", 4, 64, "lo", deadline_s=0.5)


@pytest.mark.parametrize(
    "mode",
    ["pickle", "wrong_seq", "oversized", "trailing", "bad_state", "bad_notification", "silent", "spin"],
)
def test_a_hostile_landing_process_cannot_run_code_block_or_be_believed(
    mode: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call is answered the way the mode says: a pickle whose loading would run a command, a reply
    to another call, a length of 1 GiB, trailing bytes, a transfer state out of range, a notification
    naming an agent no wire allows, or nothing at all (asleep, or spinning). Each time: the command never
    ran, nothing was believed (the WRITE is ERR, no notification), and the process was killed and another
    started."""
    marker = tmp_path / "pwned"
    monkeypatch.setenv("UCX_TEST_MARKER", str(marker))
    agent = HostileLanding(mode)
    try:
        first = agent.pid
        write = agent.write("peer", AreaLayout(0x20000, 4, 64), [(0, 1)], "r1")
        state = agent.poll(write)
        notes = agent.notified()
        # bad_notification answers WRITE and POLL honestly: only its notifications are not believed.
        assert state == ("DONE" if mode == "bad_notification" else "ERR")
        assert notes == [] and agent.restarts >= 1
        assert first is not None and gone(first)
        assert not marker.exists()
    finally:
        agent.close()
    # The same frames, read by what the worker used to use (multiprocessing.Connection.recv: a pickle),
    # would have run the command: the danger is real.
    if mode == "pickle":
        from hostile_landing import Payload

        pickle.loads(pickle.dumps(Payload()))
        assert marker.exists()


def test_a_landing_process_that_keeps_failing_is_given_up() -> None:
    """Restarts back off and stop: past the limit no process is started again, none is left running, and
    every call fails (its worker then takes no one-sided KV) instead of looping on restarts."""
    agent = HostileLanding("wrong_seq")
    agent.backoff = Restarts(limit=2, base_s=0.01)
    pids = set()
    try:
        deadline = time.monotonic() + WAIT_S
        while not agent.given_up:
            assert time.monotonic() < deadline, "never given up"
            pids.add(agent.pid)
            agent.check()
            assert agent.notified() == []
        assert agent.restarts == 3 and agent.pid is None and agent.describe()["state"] == "given up"
        assert all(gone(pid) for pid in pids - {None})
        with pytest.raises(LandingLost, match="given up"):
            agent.metadata()
        agent.check()  # nothing starts again
        assert agent.pid is None and agent.incarnation == 2
    finally:
        agent.close()


@contextmanager
def starved(pid: int) -> Iterator[None]:
    """`pid` barely gets a CPU: SCHED_IDLE, pinned to one CPU beside a busy loop pinned there too."""
    cpu = min(os.sched_getaffinity(0))
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(pid, {cpu})
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))
        yield
    finally:
        hog.kill()
        hog.wait()


def test_an_honest_landing_process_the_scheduler_starves_is_not_replaced() -> None:
    """A 10 ms deadline and a landing process that must wait for a CPU at every call (SCHED_IDLE, pinned
    beside a busy loop): each call is answered and the process is never replaced, because what it waited
    for a CPU does not count against it (tests/unit/test_lifetime.py shows the rule itself on a process
    starved far past its budget)."""
    agent = LandingAgent("starved", 4, 64, "lo", deadline_s=0.01)
    try:
        pid = agent.pid
        assert pid is not None
        with starved(pid):
            before = sched_times(pid)
            for _ in range(5):
                assert agent.metadata() and agent.notified() == []
            after = sched_times(pid)
        assert before is not None and after is not None
        assert after[1] > before[1]  # it did wait for a CPU
        assert agent.restarts == 0 and agent.pid == pid
    finally:
        agent.close()


def test_a_call_to_a_starting_landing_process_fails_at_once() -> None:
    """While a replacement starts, calls raise LandingLost instead of waiting for it."""
    agent = LandingAgent("starting", 4, 64, "lo")
    try:
        assert agent.pid is not None
        os.kill(agent.pid, signal.SIGKILL)
        with pytest.raises(LandingLost):
            agent.metadata()  # finds it dead: killed, another started
        with pytest.raises(LandingLost, match="starting"):
            agent.metadata()  # the new one has not answered START yet (imports take a second)
    finally:
        agent.close()


def test_a_forged_write_reaches_no_worker_memory() -> None:
    """A rogue agent holding the landing process's metadata aims WRITEs at the worker's own canary (an
    address in the worker's process) and past the area: whatever UCX does with them, it does in the
    landing process. The canary is unchanged, and the landing area still takes honest writes."""
    canary = np.full(4096, 0x5A, dtype=np.uint8)
    victim = LandingAgent("victim", 4, 64, "lo")
    rogue = NixlAgent(f"rogue-{os.getpid()}", new_area(64, 64))
    rogue.area[:] = 0xEE
    try:
        peer = rogue.add_peer(victim.metadata())
        for forged in (
            AreaLayout(canary.ctypes.data, 64, 64),
            AreaLayout(victim.layout.base + 4 * 64, 8, 64),
        ):
            try:
                write = rogue.write(peer, forged, [(0, 0)], "forged")
                deadline = time.monotonic() + WAIT_S
                while rogue.poll(write) == "PROC" and time.monotonic() < deadline:
                    victim.notified()
            except Exception:  # NIXL may refuse the descriptor outright: also fine
                pass
        assert (canary == 0x5A).all()
        honest = NixlAgent(f"honest-{os.getpid()}", new_area(4, 64))
        honest.area[:] = 3
        try:
            write = honest.write(honest.add_peer(victim.metadata()), victim.layout, [(0, 3)], "ok")
            assert wait_written(honest, victim, write) == "DONE" and (victim.area[3] == 3).all()
        finally:
            honest.close()
    finally:
        rogue.close()
        victim.close()


def test_the_area_cannot_be_resized_by_the_landing_process() -> None:
    """The area is a sealed memfd: truncating it (which would make the worker's reads fault) is refused
    to any holder of the descriptor."""
    agent = LandingAgent("sealed", 4, 64, "lo")
    try:
        with pytest.raises(PermissionError):
            os.ftruncate(agent._fd, 0)
        with pytest.raises(PermissionError):
            os.ftruncate(agent._fd, 1 << 20)
        agent.area[:] = 1  # still mapped, still its size
        assert int(agent.area.sum()) == 4 * 64
    finally:
        agent.close()
