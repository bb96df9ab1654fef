"""The landing process: UCX out of the worker's process, on the worker's own interface, without root.

UCX authenticates nobody and over TCP checks no address against registered memory, so the worker must
share nothing with UCX but its sealed area. Each protection is shown against its absence: an agent with
no interface named listens beyond loopback, an agent in the worker's process maps UCX into it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from kvfence.disagg.landing import NOBODY, LandingAgent, interface_of
from kvfence.disagg.nixl_transport import AreaLayout, NixlAgent, new_area, nixl_available

pytestmark = pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed: no landing process")
WAIT_S = 10.0


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


def test_ucx_listens_only_on_the_workers_interface() -> None:
    """Named `lo` (the interface of 127.0.0.1), the landing process listens there alone; with none named,
    UCX listens on every interface the host has (what a loopback deployment exposed before)."""
    fenced, open_ = (
        LandingAgent("fenced", 4, 64, interface_of("127.0.0.1")),
        LandingAgent("open", 4, 64, None),
    )
    try:
        assert interface_of("127.0.0.1") == "lo" and fenced.pid is not None and open_.pid is not None
        assert listeners(fenced.pid) == {"127.0.0.1"}
        wide = listeners(open_.pid)
        assert wide and wide != {"127.0.0.1"}, wide
    finally:
        fenced.close()
        open_.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="runs as root only where it was started as root")
def test_the_landing_process_drops_root() -> None:
    agent = LandingAgent("unprivileged", 4, 64, "lo")
    try:
        status = open(f"/proc/{agent.pid}/status").read()  # noqa: SIM115
        uids = re.search(r"^Uid:\s+(\d+)\s+(\d+)", status, flags=re.MULTILINE)
        assert uids and (int(uids.group(1)), int(uids.group(2))) == (NOBODY, NOBODY)
        assert agent.describe()["uid"] == NOBODY
    finally:
        agent.close()


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


def test_a_dead_landing_process_fails_its_write_and_is_restarted() -> None:
    """Killed with a WRITE in flight: that WRITE is ERR (its transfer fails closed), the worker's side goes
    on, and the next call runs in a new landing process over the same area, peers re-added."""
    sender, receiver = LandingAgent("sender", 4, 64, "lo"), LandingAgent("receiver", 4, 64, "lo")
    try:
        sender.area[:] = 9
        peer = sender.add_peer(receiver.metadata())
        write = sender.write(peer, receiver.layout, [(0, 1)], "r1")
        assert sender.pid is not None
        os.kill(sender.pid, 9)
        assert wait_written(sender, receiver, write) == "ERR"
        assert (sender.restarts, sender.incarnation) == (1, 1)
        again = sender.write(peer, receiver.layout, [(1, 2)], "r2")  # the re-added peer, the same area
        assert wait_written(sender, receiver, again) == "DONE"
        assert (receiver.area[2] == 9).all()
    finally:
        sender.close()
        receiver.close()


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
