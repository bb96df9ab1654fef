"""`make test`'s runner: pytest under a child subreaper, optionally beside CPU hogs, then a check that the
suite left no process alive.

    python tests/suite.py [--hogs N] [-- PYTEST ARGS]

Every process the suite starts ends below this one, even one whose parent died (the kernel re-parents an
orphan to its nearest subreaper, PR_SET_CHILD_SUBREAPER), so what is alive below it once pytest has ended
is exactly what the suite left running. Each is named, killed, and the run fails: exit 3, or pytest's own
code where that is worse. `--hogs N` starts N busy loops first and stops them after (the loaded stage:
the suite must pass on a machine that is busy with something else). Zombies are reaped as they come, as
init would.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

from kvfence.harness.procs import busy_loops, descendants, live_command

_PR_SET_CHILD_SUBREAPER = 36
LEFTOVERS = 3  # the exit code of a suite that left a process alive
SETTLE_S = 2.0  # how long the suite's last processes get to exit by themselves (their parents just did)


def run(pytest_args: list[str]) -> int:
    """pytest as a child; every other child that ends meanwhile (an orphan re-parented here) is reaped."""
    suite = subprocess.Popen([sys.executable, "-m", "pytest", *pytest_args])
    while True:
        pid, status = os.wait()
        if pid == suite.pid:
            return os.waitstatus_to_exitcode(status)


def leftovers() -> list[tuple[int, str]]:
    """What is alive below this process now (the hogs are gone): (pid, command line)."""
    found = [(pid, live_command(pid)) for pid in descendants(os.getpid())]
    return [(pid, command) for pid, command in found if command is not None]


def reap() -> None:
    """Collect every child that has ended (never blocks)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=0, help="busy loops to run beside the suite")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
    started = time.monotonic()
    with busy_loops(args.hogs) as hogs:
        if hogs:
            print(f"suite: {len(hogs)} CPU hogs beside it (pids {' '.join(map(str, hogs))})", flush=True)
        code = run(args.pytest_args)
    print(f"suite: pytest ended with {code} after {time.monotonic() - started:.0f} s", flush=True)
    deadline = time.monotonic() + SETTLE_S
    while (left := leftovers()) and time.monotonic() < deadline:
        reap()
        time.sleep(0.1)
    for pid, command in left:
        print(f"suite: LEFT RUNNING by the suite, killed: pid {pid}: {command[:300]}", flush=True)
        os.kill(pid, signal.SIGKILL)
    reap()
    if left:
        return max(code, LEFTOVERS) if code else LEFTOVERS
    print("suite: no process of the suite is left running", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
