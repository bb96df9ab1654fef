"""The fence's cost inside vLLM, per scheduler process: the hooks' seconds against the steps' own time.

`scheduler_s` is the scheduler hook's time (records synced and judged), `worker_s` the worker hook's
(fault, row check, neutralising), as the worker reports it per step; `step_s` sums each step from the
start of its schedule to the arrival of its output (so idle time between requests is not counted).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class FenceStats:
    scheduler_s: float = 0.0
    worker_s: float = 0.0
    step_s: float = 0.0
    steps: int = 0
    step_started: float = 0.0

    def start_step(self) -> None:
        self.step_started = time.perf_counter()

    def end_step(self, worker_s: float) -> int:
        """One step's output arrived; returns the steps counted so far."""
        self.step_s += time.perf_counter() - self.step_started
        self.worker_s += worker_s
        self.steps += 1
        return self.steps

    def line(self) -> str:
        spent, steps = self.scheduler_s + self.worker_s, max(self.steps, 1)
        parts = f"scheduler {1e3 * self.scheduler_s / steps:.3f}, worker {1e3 * self.worker_s / steps:.3f}"
        share = 100 * spent / max(self.step_s, 1e-9)
        per_step = f"fence {1e3 * spent / steps:.3f} ms/step ({parts})"
        return f"{per_step} over {self.steps} steps: {share:.2f}% of a step"
