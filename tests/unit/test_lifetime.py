"""How long a helper lives (kvfence/lifetime.py): restarts back off and stop, a deadline waits for a peer
the scheduler starves but not for one stopped, asleep or spinning, and a child dies with its parent.

Nothing here asserts how long anything took: each test waits (bounded) for an outcome, or checks what the
policy decides from the times and scheduler counters it is given."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvfence.config import EngineConfig
from kvfence.disagg.launch import LocalWorkers
from kvfence.lifetime import Progress, Restarts, process_state, sched_times

WAIT_S = 30.0
SPIN = [sys.executable, "-c", "while True: pass"]


def test_restarts_back_off_then_give_up() -> None:
    restarts = Restarts(limit=5, base_s=0.5, cap_s=2.0)
    delays = [restarts.failed(now=float(i), up_since=None) for i in range(6)]
    assert delays == [0.0, 0.5, 1.0, 2.0, 2.0, None]
    assert restarts.given_up and restarts.total == 6


def test_a_helper_that_served_long_enough_starts_a_new_count() -> None:
    restarts = Restarts(limit=2, stable_s=60.0)
    assert restarts.failed(0.0, up_since=None) == 0.0
    assert restarts.failed(10.0, up_since=5.0) == 0.5  # it served 5 s: the same failure again
    assert restarts.failed(100.0, up_since=20.0) == 0.0  # it served 80 s: a new run of failures
    assert not restarts.given_up and restarts.in_a_row == 1


@contextmanager
def child(argv: list[str]) -> Iterator[subprocess.Popen[bytes]]:
    process = subprocess.Popen(argv)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def wait_past(progress: Progress, seconds: float) -> float:
    """Sleep until `seconds` after the wait began; the time then."""
    while (now := time.monotonic()) < progress.start + seconds:
        time.sleep(0.02)
    return now


@pytest.mark.parametrize("how", ["stopped", "asleep", "spinning"])
def test_a_peer_that_makes_no_progress_is_overdue(how: str) -> None:
    """SIGSTOP, a sleep that never ends, a loop that never answers: each is overdue once it had the
    budget (the spinning one by the CPU it used, however long it waited for it)."""
    argv = [sys.executable, "-c", "import time; time.sleep(3600)"] if how == "asleep" else SPIN
    with child(argv) as process:
        if how == "stopped":
            os.kill(process.pid, signal.SIGSTOP)
        progress = Progress(process.pid, time.monotonic(), budget_s=0.2, cap_s=3600.0)
        assert not progress.overdue(progress.start)
        deadline = time.monotonic() + WAIT_S
        while not progress.overdue(time.monotonic()):
            assert time.monotonic() < deadline, "never overdue"
            time.sleep(0.02)


@contextmanager
def starved() -> Iterator[int]:
    """A process that wants a CPU and barely gets one: a busy loop under SCHED_IDLE, pinned to one CPU
    beside an ordinary busy loop pinned there too."""
    cpu = min(os.sched_getaffinity(0))
    with child(SPIN) as hog, child(SPIN) as victim:
        os.sched_setaffinity(hog.pid, {cpu})
        os.sched_setaffinity(victim.pid, {cpu})
        os.sched_setscheduler(victim.pid, os.SCHED_IDLE, os.sched_param(0))
        yield victim.pid


def test_a_peer_the_scheduler_starves_is_waited_for_up_to_the_cap() -> None:
    """Past its budget in wall time, a starved peer is not overdue: it could not run. A plain deadline
    (the budget in wall time) would have ended it; the cap still does."""
    with starved() as pid:
        progress = Progress(pid, time.monotonic(), budget_s=0.2, cap_s=1.5)
        now = wait_past(progress, 1.0)
        ran = (sched_times(pid) or (0.0, 0.0))[0] - progress._base[0]
        assert now - progress.start >= progress.budget_s  # the plain deadline has passed...
        assert ran < progress.budget_s and process_state(pid) == "R"  # ...but it barely ran: it waits
        assert not progress.overdue(now)
        assert progress.overdue(wait_past(progress, 1.5))  # the cap


@pytest.mark.parametrize("how", ["exit_with_parent", "watch_parent"])
def test_a_child_dies_with_its_parent(how: str) -> None:
    """A parent killed with SIGKILL (so it cleans nothing up) whose child armed `how`: the child ends (the
    kernel's signal, or its own watch). A child whose named parent is already gone exits at once."""
    grandchild = (
        f"import sys, time; from kvfence.lifetime import {how}; "
        f"{how}(int(sys.argv[1])); print('armed', flush=True); time.sleep(3600)"
    )
    code = (
        "import os, subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {grandchild!r}, str(os.getpid())])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(3600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    assert parent.stdout.readline() == "armed\n"
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + WAIT_S
    while process_state(pid) not in ("exited", "Z"):
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)
    orphan = subprocess.run(
        [sys.executable, "-c", f"from kvfence.lifetime import {how}; {how}(1); print('alive')"],
        timeout=WAIT_S,
        capture_output=True,
    )
    assert orphan.returncode == 1 and orphan.stdout == b""


class DeadWorker:
    """A worker process that has exited."""

    exitcode = 1

    def is_alive(self) -> bool:
        return False


def test_a_worker_that_keeps_dying_is_restarted_with_backoff_then_given_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`serve --disaggregated`'s supervisor: each death waits out its backoff before the next start; past
    the limit the worker is left down (said in the log) instead of being started forever."""
    workers = LocalWorkers([("decode", EngineConfig())], {"decode": "tcp://127.0.0.1:1"}, None)
    started: list[list[str]] = []

    def spawn(names: list[str]) -> list[tuple[DeadWorker, str]]:
        started.append(names)
        return [(DeadWorker(), "tcp://127.0.0.1:1")]

    workers._spawn = spawn  # type: ignore[assignment]
    workers.backoff["decode"] = Restarts(limit=2, base_s=3600.0, cap_s=3600.0)
    workers.processes["decode"] = DeadWorker()  # type: ignore[assignment]
    workers._restart("decode", 1)
    assert started == [["decode"]]  # the first restart is at once
    workers._restart("decode", 1)
    workers._restart("decode", 1)
    assert started == [["decode"]]  # the second waits an hour: not yet
    workers.due["decode"] = 0.0  # the hour is over
    workers._restart("decode", 1)
    assert started == [["decode"], ["decode"]] and not workers.given_up
    workers._restart("decode", 1)
    assert workers.given_up == {"decode"} and workers.restarts == 3 and len(started) == 2
    assert "exited (code 1) 3 times in a row: given up" in capsys.readouterr().out
