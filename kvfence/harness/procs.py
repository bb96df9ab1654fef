"""`kvfence` commands as OS processes: start one, wait for it to be ready, stop it and everything below it.

Contracts: a process's stdout and stderr are collected by a thread (the pipe never fills) and shown in
the error when it exits or does not get ready in time; every wait is bounded; `stop` is idempotent and
leaves no descendant behind (a `serve --disaggregated` parent's worker processes included), killing by
pid only, never by name. A command may run after a prefix (`ip netns exec NS`): the prefix must exec the
command, as `ip netns exec` does, so that the pid is the kvfence process itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvfence.harness.server import healthy
from kvfence.lifetime import PARENT_ENV, process_state

KVFENCE = (sys.executable, "-m", "kvfence")  # the command for this interpreter, installed or on PYTHONPATH
START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0


@dataclass
class Proc:
    """A `kvfence` subprocess whose output is collected (and echoed on failure)."""

    name: str
    command: str  # as typed by an operator: `kvfence ...` (without the prefix)
    popen: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 30) -> str:
        return "".join(self.log[-lines:])

    def first_match(self, pattern: str) -> re.Match[str]:
        """The first line it printed that matches `pattern` (AssertionError with the tail if none)."""
        found = [m for line in self.log if (m := re.search(pattern, line))]
        assert found, f"{self.name}: no line matching {pattern!r}:\n{self.tail()}"
        return found[0]

    def wait_for_line(self, text: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until the process prints a line containing `text` (RuntimeError if it exits or times out)."""
        deadline = time.monotonic() + timeout_s
        while not any(text in line for line in self.log):
            self._check_alive(deadline, f"print {text!r}")
            time.sleep(0.2)

    def wait_for_http(self, url: str, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until `url`/health answers 200 (RuntimeError if the process exits or times out)."""
        deadline = time.monotonic() + timeout_s
        while not healthy(url):
            self._check_alive(deadline, f"serve {url}")
            time.sleep(0.5)

    def _check_alive(self, deadline: float, what: str) -> None:
        if self.popen.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.popen.returncode}):\n{self.tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{self.name} did not {what} in time:\n{self.tail()}")

    def kill(self, timeout_s: float = 10.0) -> None:
        """kill -9, and wait (bounded) for the process to be gone."""
        if self.popen.poll() is None:
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=timeout_s)


def launch(
    name: str,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    echo: bool = True,
) -> Proc:
    """Start `[prefix] kvfence ARGS` (stdout and stderr collected by a thread, so the pipe never fills);
    `echo` prints the command as an operator would type it. The process exits when this one ends,
    whatever else stops it (`lifetime.PARENT_ENV`)."""
    command = " ".join(["kvfence", *args])
    if echo:
        print(f"  $ {command}", flush=True)
    popen = subprocess.Popen(
        [*prefix, *KVFENCE, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {}), PARENT_ENV: str(os.getpid())},
    )
    proc = Proc(name, command, popen)
    threading.Thread(target=_collect, args=(proc,), daemon=True).start()
    return proc


def _collect(proc: Proc) -> None:
    assert proc.popen.stdout is not None
    for line in proc.popen.stdout:
        proc.log.append(line)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (found through the parent pids in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def live_command(pid: int) -> str | None:
    """The command line of `pid` while it is alive and not a zombie, else None."""
    if process_state(pid) in ("Z", "exited"):
        return None
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None  # gone meanwhile


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) `pid` and every live process below it have used so far."""
    return sum(process_cpu_seconds(each) for each in (pid, *descendants(pid)))


def process_cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of `pid` alone so far; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0  # gone meanwhile
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat's 14, 15)


def memory_mb(pid: int) -> tuple[float, float]:
    """(resident set now, its peak) of one process in MiB: VmRSS and VmHWM of /proc/PID/status."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return tuple(int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))  # type: ignore[return-value]


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """`count` processes that spin on a CPU each until the block ends (a busy machine's neighbours: the
    loaded test stage, the deadline bench); yields their pids."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield [loop.pid for loop in loops]
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def stop(procs: Sequence[Proc], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM (a `serve --disaggregated` parent then kills its workers itself), then SIGKILL whatever of
    the process tree is left, by pid. Processes already gone are fine."""
    trees = {proc.pid: descendants(proc.pid) for proc in procs}
    for proc in procs:
        if proc.popen.poll() is None:
            proc.popen.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    for pid in (child for tree in trees.values() for child in tree):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
