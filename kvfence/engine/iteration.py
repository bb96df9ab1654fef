"""Tokens per engine step, the histogram vLLM exports as `vllm:iteration_tokens_total`.

Contract: a step's tokens are what vLLM's IterationStats adds up, the prompt tokens the step computed
(prefix-cache hits excluded: nothing computed them) plus the tokens it generated; every step that ran a
batch is observed once. Over a run the sum is every prompt token computed plus every token generated.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# vLLM's buckets (v1 metrics/loggers.py), upper bounds; one more count past the last for +Inf.
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass
class StepTokens:
    """The histogram: steps per bucket (not cumulative, +Inf last) and the tokens they summed to."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_BUCKETS) + 1))
    total: int = 0

    def observe(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(ITERATION_BUCKETS, tokens)] += 1  # le: a step of 8 counts under 8
        self.total += tokens
