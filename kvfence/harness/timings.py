"""A benchmark run's timings: each request's TTFT, TPOT and latency, the run's totals, its percentiles and
its row in a table.

Contracts: every time is in seconds from the request's arrival (`time.monotonic()`, the clock `Request`
uses for arrival_time / first_token_time / finish_time); `RunResult.summary()` is JSON-ready, its
percentiles in ms; `run_cells` is a row under RUN_HEADERS (TTFT and TPOT in ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfence.request import Request


@dataclass
class RequestTiming:
    """Seconds from the request's arrival (when it was handed to the engine / its batch started)."""

    ttft: float
    tpot: float  # mean inter-token time after the first token
    latency: float  # arrival to last token
    num_output: int


@dataclass
class RunResult:
    label: str
    concurrency: int
    num_requests: int
    wall_s: float
    output_tokens: int
    timings: list[RequestTiming] = field(repr=False)
    step_s: float = 0.0  # summed engine.step() wall time (kvfence only)
    fence_s: float = 0.0  # fence validation time within those steps (kvfence only)
    steps: int = 0
    foreign_cpu: float = 0.0  # share of the machine's CPU other processes used meanwhile (see ForeignCpu)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def pct(self, metric: str, q: float) -> float:
        return float(np.percentile([getattr(t, metric) for t in self.timings], q))

    def summary(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "label": self.label,
            "concurrency": self.concurrency,
            "num_requests": self.num_requests,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "output_tok_per_s": self.tok_per_s,
            "steps": self.steps,
            "step_s": self.step_s,
            "fence_s": self.fence_s,
            "foreign_cpu": self.foreign_cpu,
        }
        for metric in ("ttft", "tpot", "latency"):
            for q in (50, 95):
                out[f"{metric}_p{q}_ms"] = self.pct(metric, q) * 1e3
        return out


def request_timing(request: Request) -> RequestTiming:
    assert request.first_token_time is not None and request.finish_time is not None
    n = len(request.output_token_ids)
    decode_s = request.finish_time - request.first_token_time
    return RequestTiming(
        ttft=request.first_token_time - request.arrival_time,
        tpot=decode_s / (n - 1) if n > 1 else 0.0,
        latency=request.finish_time - request.arrival_time,
        num_output=n,
    )


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return float(np.median(values)), float(min(values)), float(max(values))


# A RunResult as a table row: RUN_HEADERS over run_cells (TTFT and TPOT in ms).
RUN_HEADERS = (
    "system",
    "conc",
    "reqs",
    "wall s",
    "out tok/s",
    "TTFT p50",
    "TTFT p95",
    "TPOT p50",
    "TPOT p95",
    "others %",
)


def run_cells(result: RunResult) -> list[object]:
    return [
        result.label,
        result.concurrency,
        result.num_requests,
        result.wall_s,
        result.tok_per_s,
        *(result.pct(metric, q) * 1e3 for metric in ("ttft", "tpot") for q in (50, 95)),
        f"{result.foreign_cpu * 100:.0f}",
    ]
