"""Prometheus metrics: the HTTP layer's request counters and latency histograms, and the engine's stats.

Contracts:
- Each app's metrics live in a registry of their own, so several apps can share one process.
- Every request is counted once in `kvfence_requests` by its final status, however it ends (finished,
  aborted, refused at admission, client gone); an admission refusal is also counted by its reason.
- The engine's counters and gauges are read from `engine.stats()` at scrape time, never cached, one series
  per role (`single`, or `prefill` and `decode`, and `router` for its dropped frames): pools are never
  summed, so a full decode pool cannot hide behind an idle prefill pool. `kvfence_pages_free` counts the
  pages an allocation can take now, free or cached-and-idle; `kvfence_pages{state="free"}` only the free.
- Closing the observed stream closes the engine's stream, which aborts the engine request.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Callable, Iterator
from contextlib import aclosing

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvfence.engine.async_engine import EngineClient
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.request import Status

_Outputs = AsyncGenerator[RequestOutput, None]


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily],
    name: str,
    doc: str,
    stats: dict[str, EngineStats],
    value: Callable[[EngineStats], float | dict[str, float]],
    label: str | None = None,
) -> Metric:
    """One series per role (and per `label` value, when `value` gives a dict); roles without a pool
    (the router) only in the families that have a `label` (their dropped frames)."""
    family = kind(name, doc, labels=["role"] + ([label] if label else []))
    for role, s in stats.items():
        values = value(s)
        if isinstance(values, dict):
            for key, v in values.items():
                family.add_metric([role, key], v)
        elif s.num_pages:
            family.add_metric([role], values)
    return family


class _EngineCollector:
    """Prometheus collector for the engine's own counters and gauges, read at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        pools = {role: s for role, s in stats.items() if s.num_pages}
        yield _family(
            gauge,
            "kvfence_pages_free",
            "KV pages an allocation can take now (free, or cached and idle)",
            stats,
            lambda s: s.pages_free,
        )
        yield _family(
            gauge,
            "kvfence_pages_used",
            "KV pages held by requests",
            stats,
            lambda s: s.num_pages - s.pages_free,
        )
        yield _family(
            gauge, "kvfence_pages", "KV pages by allocator state", pools, lambda s: s.pages_by_state, "state"
        )
        yield _family(
            counter,
            "kvfence_prefix_cache_hits",
            "Pages served from the prefix cache",
            stats,
            lambda s: s.prefix_hits,
        )
        yield _family(
            counter,
            "kvfence_integrity_aborts",
            "Requests aborted by the KV fence, by reason",
            pools,
            lambda s: s.integrity_aborts,
            "reason",
        )
        yield _family(
            counter,
            "kvfence_refused_writes",
            "KV writes refused (stale generation or foreign owner)",
            stats,
            lambda s: s.refused_writes,
        )
        yield _family(
            counter,
            "kvfence_fence_checks",
            "Batched fence validations run",
            stats,
            lambda s: s.validation_checks,
        )
        yield _family(
            counter,
            "kvfence_transport_rejected",
            "Frames between router and workers dropped before being acted on, by reason",
            stats,
            lambda s: s.transport_rejected,
            "reason",
        )
        yield _family(
            counter,
            "kvfence_fence_validation_seconds",
            "Time spent in fence validation",
            stats,
            lambda s: s.validation_seconds,
        )


class Metrics:
    """The app's metrics, in a registry of its own (so several apps can live in one process)."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfence_requests", "Requests by final status", ["status"], registry=r)
        self.prompt_tokens = Counter(
            "kvfence_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("kvfence_generation_tokens", "Tokens generated", registry=r)
        self.rejections = Counter(
            "kvfence_admission_rejections", "Requests refused at admission, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Arrival to first generated token",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tpot = Histogram(
            "kvfence_time_per_output_token_seconds",
            "Mean time per token after the first",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        r.register(_EngineCollector(engine))

    async def observe(self, outputs: _Outputs) -> _Outputs:
        """Pass `outputs` through, recording the request once however it ends (closing this closes
        `outputs`, which aborts the engine request)."""
        arrived, first_token_at, last, status = time.monotonic(), None, None, "aborted"
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    if first_token_at is None and output.new_token_ids:
                        first_token_at = time.monotonic()
                        self.ttft.observe(first_token_at - arrived)
                    last = output
                    if output.finished:
                        status = output.status.value
                    yield output
        except AdmissionError as exc:
            status = Status.REJECTED.value
            self.rejections.labels(exc.code).inc()
            raise
        finally:
            self._record(status, last, first_token_at)

    def _record(self, status: str, last: RequestOutput | None, first_token_at: float | None) -> None:
        self.requests.labels(status).inc()
        if last is None:
            return
        self.prompt_tokens.inc(last.prompt_tokens)
        self.generation_tokens.inc(last.completion_tokens)
        if first_token_at is not None and last.completion_tokens > 1:
            self.tpot.observe((time.monotonic() - first_token_at) / (last.completion_tokens - 1))
