"""The shared machine: how much of its CPU other processes took during a run, and waiting for a quiet one.

Torch's OpenMP threads slow down far more than proportionally when they share cores, so a run during which
others took cores is noise. Contracts: `ForeignCpu.share()` is the share of all CPUs that processes other
than this one (and the hypervisor's steal) used since construction, from /proc/stat and os.times();
`wait_for_quiet` and `quietly` wait a bounded time, then go ahead (the run's share then flags it).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")

CONTENDED = 0.15  # a run during which other processes used more than this share of all CPUs is suspect


def _cpu_seconds() -> tuple[float, float, float]:
    """(now, busy CPU seconds of the whole machine incl. steal, CPU seconds of this process)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, own.user + own.system


class ForeignCpu:
    """How much of the machine other processes (and the hypervisor) used since construction: 0.0 means
    this process had every core to itself, 0.5 that others took half of all cores. Torch's OpenMP threads
    slow down far more than proportionally when they have to share cores, so a contended run is noise."""

    def __init__(self) -> None:
        self._start = _cpu_seconds()

    def share(self) -> float:
        now, busy, own = _cpu_seconds()
        t0, busy0, own0 = self._start
        elapsed = max(now - t0, 1e-9)
        return max(0.0, ((busy - busy0) - (own - own0)) / (elapsed * (os.cpu_count() or 1)))


def wait_for_quiet(max_wait_s: float = 90.0, threshold: float = CONTENDED) -> float:
    """Sleep (1 s probes) until other processes use less than `threshold` of the CPUs; returns the share
    seen last. Gives up after `max_wait_s`: the run then goes ahead and its foreign_cpu flags it."""
    started = time.monotonic()
    for probes in itertools.count():
        probe = ForeignCpu()
        time.sleep(1.0)
        share = probe.share()
        waited = time.monotonic() - started
        if share < threshold or waited > max_wait_s:
            if probes:
                print(f"  (waited {waited:.0f}s for a quiet machine; others now at {share * 100:.0f}%)")
            return share
        if probes % 15 == 0:
            print(f"  (waiting: other processes use {share * 100:.0f}% of the CPUs)", flush=True)
    raise AssertionError("unreachable")


def contention_threshold() -> float:
    """Others' CPU share above which they must have taken cores our torch threads needed: CONTENDED plus
    the share of cores we leave idle (with 1 thread on 2 cores another process may use one core freely)."""
    cpus = os.cpu_count() or 1
    return CONTENDED + max(0, cpus - torch.get_num_threads()) / cpus


def quietly(run: Callable[[], T], contention: Callable[[T], float], retries: int) -> tuple[T, int]:
    """Wait for a quiet machine, then `run`; redo it (up to `retries` times) while `contention` of the
    result exceeds contention_threshold(). Returns the last result and how many were discarded."""
    threshold = contention_threshold()
    for attempt in range(retries + 1):
        wait_for_quiet(threshold=threshold)
        result = run()
        share = contention(result)
        if share <= threshold or attempt == retries:
            return result, attempt
        print(
            f"  (discarded: other processes used {share * 100:.0f}% of the CPUs during the run)", flush=True
        )
    raise AssertionError("unreachable")
