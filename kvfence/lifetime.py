"""How long a helper process lives: it ends with its parent, its restarts are bounded, and a deadline on it
tells a peer that makes no progress from one the scheduler starves.

Contract:
- `exit_with_parent(parent)` (in the child): the kernel sends SIGKILL when the parent's *thread* that
  started the child ends (PR_SET_PDEATHSIG), even if this process is wedged in C; a parent already gone
  is caught by comparing `getppid()` with the pid it named. A credentials change clears the signal, so a
  child that drops privileges arms it after. For a helper started from the thread that serves (the
  landing process, from its worker's loop).
- `watch_parent(parent)` (in the child): a daemon thread exits the process within `every_s` of its parent
  being gone (re-parented), whichever thread of the parent started it: for workers and commands, which a
  supervisor's or a test's short-lived thread may start.
- `Restarts` says how long to wait before starting a helper that failed again (at once, then `base_s`
  doubling up to `cap_s`), and gives up after `limit` failures in a row; a helper that served `stable_s`
  clears the count. It reads no clock: the caller passes the times.
- `Progress` ends a wait on another process by what that process could do, not by the wall clock alone:
  overdue once its main thread (the one that answers) has used `budget_s` of CPU, or once it is not
  runnable and has had `budget_s` in which it could have run (wall time less what it waited for a CPU:
  /proc/PID/schedstat), or at `cap_s` of wall time whatever it did. A stopped (SIGSTOP) or sleeping
  process waits for no CPU: overdue at `budget_s`, as a plain deadline would be; one that is runnable
  but starved is waited for up to `cap_s`.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

PARENT_ENV = "KVFENCE_PARENT_PID"  # set by a parent that wants its `kvfence` children to end with it
_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent (pid `parent`) ends; exit now if it already has."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the parent ended before the signal was armed
        os._exit(1)


def watch_parent(parent: int, every_s: float = 0.5) -> None:
    """Exit this process (status 1) once `parent` is no longer its parent: now, or within `every_s`."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every_s)
        os._exit(1)

    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=watch, name="kvfence-parent-watch", daemon=True).start()


def exit_with_named_parent() -> None:
    """`watch_parent` when the environment names this process's parent (`PARENT_ENV`): a test harness or
    supervisor asks it so that nothing it started outlives it; an operator's shell does not."""
    named = os.environ.get(PARENT_ENV, "")
    if named.isdigit():
        watch_parent(int(named))


@dataclass
class Restarts:
    """The backoff of one helper that keeps failing. `failed(now, up_since)` after each failure: the delay
    before the next start, or None once `limit` failures came in a row (the caller then stops trying and
    fails closed). `up_since`: when the failed helper began serving (None: it never did)."""

    limit: int = 5
    base_s: float = 0.5
    cap_s: float = 30.0
    stable_s: float = 60.0
    in_a_row: int = 0
    total: int = 0

    def failed(self, now: float, up_since: float | None) -> float | None:
        if up_since is not None and now - up_since >= self.stable_s:
            self.in_a_row = 0  # it served long enough: this is a new failure, not the same one again
        self.in_a_row += 1
        self.total += 1
        if self.in_a_row > self.limit:
            return None
        return 0.0 if self.in_a_row == 1 else min(self.cap_s, self.base_s * 2 ** (self.in_a_row - 2))

    @property
    def given_up(self) -> bool:
        return self.in_a_row > self.limit


def process_state(pid: int) -> str:
    """A process's state letter from /proc (T: stopped, t: traced, Z: a zombie), "exited" when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return "exited"


def sched_times(pid: int) -> tuple[float, float] | None:
    """(seconds on a CPU, seconds runnable but waiting for one) of `pid`'s main thread so far (the one
    that answers a call); None when it is gone."""
    try:
        ran, waited, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    except (OSError, ValueError):
        return None
    return int(ran) / 1e9, int(waited) / 1e9


@dataclass
class Progress:
    """A wait on process `pid` that began at `start` (monotonic seconds)."""

    pid: int
    start: float
    budget_s: float
    cap_s: float
    _base: tuple[float, float] = field(init=False)

    def __post_init__(self) -> None:
        self._base = sched_times(self.pid) or (0.0, 0.0)

    def overdue(self, now: float) -> bool:
        elapsed = now - self.start
        if elapsed < self.budget_s:
            return False
        times = sched_times(self.pid)
        if elapsed >= self.cap_s or times is None:
            return True
        ran, waited = times[0] - self._base[0], times[1] - self._base[1]
        if ran >= self.budget_s:
            return True  # it had the CPU and did not answer
        # The kernel adds a wait to `waited` only when the thread next runs: one runnable now (R) may be
        # waiting still, so it is not judged by `waited` until it has run or stopped wanting to.
        return process_state(self.pid) != "R" and elapsed - waited >= self.budget_s
