"""Prometheus metrics: the HTTP layer's request counters and latency histograms, and the engine's stats.

Contracts:
- Each app's metrics live in a registry of their own, so several apps can share one process.
- Every request is counted once in `kvfence_requests` by its final status, however it ends (finished,
  aborted, refused at admission, client gone); an admission refusal is also counted by its reason.
- The engine's counters and gauges are read from `engine.stats()` at scrape time, never cached, one series
  per role (`single`, or `prefill` and `decode`, and `router` for its dropped frames): pools are never
  summed, so a full decode pool cannot hide behind an idle prefill pool. `kvfence_pages_free` counts the
  pages an allocation can take now: FREE ones plus cached prefix pages no request holds (still in state
  `owned`, their tenant's, evicted on demand); `kvfence_pages{state="free"}` only the FREE ones, so the gap
  is the idle prefix cache. `kvfence_kv_cache_usage_ratio` is the pages held (neither) over all pages.
- vLLM's core series, under kvfence's prefix and with a `model_name` label (the served name) so a vLLM
  dashboard reads them: requests running and waiting, KV cache usage, and the end-to-end latency of every
  request that finished normally (`kvfence_requests_total{status="finished"}` counts the same requests).
- Every request-level series has `model_name`; the engine's, `role` (and `model_name` for vLLM's). So a
  vLLM dashboard finds, under kvfence's prefix, every series it reads: tokens, TTFT, TPOT, e2e latency,
  prompt and generation lengths, finish reasons (`kvfence_request_success_total{finished_reason}`),
  queue, prefill, decode and inference time (by the engine's clock: the router's requests have none), the
  longest choice, preemptions (`kvfence_num_preemptions`, the scheduler's recompute preemptions) and tokens
  per step (`kvfence_iteration_tokens`, vLLM's buckets: engine/iteration.py). With `compat` "vllm" the
  scrape repeats them under vLLM's `vllm:` names.
- Closing the observed stream closes the engine's stream, which aborts the engine request.
- Embedding requests never reach the scheduler: they are counted apart, once answered
  (`kvfence_embedding_requests`, and their input tokens in `kvfence_embedding_prompt_tokens`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvfence.engine.async_engine import EngineClient
from kvfence.engine.engine import AdmissionError
from kvfence.engine.iteration import ITERATION_BUCKETS
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.request import Status

_Outputs = AsyncGenerator[RequestOutput, None]


@dataclass(frozen=True)
class _Family:
    """One engine metric: its kind, name and help, and how to read it from a role's EngineStats. A value
    that is a dict gives one series per key under `label`."""

    kind: type[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]
    name: str
    doc: str
    value: Callable[[EngineStats], float | dict[str, float] | tuple[list[int], float]]
    label: str | None = None
    pools_only: bool = True  # roles without a pool (the router) have no series
    model_label: bool = False  # vLLM's series carry the served model's name

    def collect(self, stats: dict[str, EngineStats], model_name: str) -> Metric:
        model = [model_name] if self.model_label else []
        labels = (
            ["role"] + (["model_name"] if self.model_label else []) + ([self.label] if self.label else [])
        )
        family = self.kind(self.name, self.doc, labels=labels)
        for role, s in stats.items():
            if self.pools_only and not s.num_pages:
                continue
            values = self.value(s)
            if isinstance(values, dict):
                for key, v in values.items():
                    self._add(family, [role, *model, key], v)
            else:
                self._add(family, [role, *model], values)
        return family

    def _add(self, family: Any, labels: list[str], value: Any) -> None:
        family.add_metric(labels, value)


@dataclass(frozen=True)
class _HistogramFamily(_Family):
    """An engine histogram: `value` gives its steps per bucket of `bounds` (not cumulative, +Inf last; none
    yet: a stats dict without them) and their sum."""

    bounds: tuple[float, ...] = ()

    def _add(self, family: Any, labels: list[str], value: Any) -> None:
        counts, total = value
        counts = counts or [0] * (len(self.bounds) + 1)
        edges = [*(str(float(b)) for b in self.bounds), "+Inf"]
        family.add_metric(labels, list(zip(edges, itertools.accumulate(counts), strict=True)), total)


_GAUGE, _COUNTER = GaugeMetricFamily, CounterMetricFamily
_ENGINE_FAMILIES = (
    _Family(
        _GAUGE,
        "kvfence_pages_free",
        "KV pages an allocation can take now: state free, plus cached prefix pages no request holds (state "
        'owned, evicted on demand); so it exceeds kvfence_pages{state="free"} by the idle prefix cache',
        lambda s: s.pages_free,
    ),
    _Family(_GAUGE, "kvfence_pages_used", "KV pages held by requests or transfers", lambda s: s.pages_held),
    _Family(
        _GAUGE,
        "kvfence_kv_cache_usage_ratio",
        "KV cache usage, 0 to 1: pages held by requests or transfers over all pages (idle cached pages "
        "count as free, as they are evicted on demand)",
        lambda s: s.pages_held / s.num_pages,
        model_label=True,
    ),
    _Family(
        _GAUGE,
        "kvfence_num_requests_running",
        "Requests the scheduler steps now (prefill or decode)",
        lambda s: s.num_running,
        model_label=True,
    ),
    _Family(
        _GAUGE,
        "kvfence_num_requests_waiting",
        "Requests queued for admission",
        lambda s: s.num_waiting,
        model_label=True,
    ),
    _Family(_GAUGE, "kvfence_pages", "KV pages by allocator state", lambda s: s.pages_by_state, "state"),
    _Family(
        _COUNTER, "kvfence_prefix_cache_hits", "Pages served from the prefix cache", lambda s: s.prefix_hits
    ),
    _Family(
        _COUNTER,
        "kvfence_integrity_aborts",
        "Requests aborted by the KV fence, by reason",
        lambda s: s.integrity_aborts,
        "reason",
    ),
    _Family(
        _COUNTER,
        "kvfence_refused_writes",
        "KV writes refused (stale generation or foreign owner)",
        lambda s: s.refused_writes,
    ),
    _Family(_COUNTER, "kvfence_fence_checks", "Batched fence validations run", lambda s: s.validation_checks),
    _Family(
        _COUNTER,
        "kvfence_fence_validation_seconds",
        "Time spent in fence validation",
        lambda s: s.validation_seconds,
    ),
    _Family(
        _COUNTER,
        "kvfence_spec_decode_num_drafts",
        "Speculative decoding: rows that verified at least one draft token",
        lambda s: s.spec_drafts,
        model_label=True,
    ),
    _Family(
        _COUNTER,
        "kvfence_spec_decode_num_draft_tokens",
        "Speculative decoding: draft tokens verified",
        lambda s: s.spec_draft_tokens,
        model_label=True,
    ),
    _Family(
        _COUNTER,
        "kvfence_spec_decode_num_accepted_tokens",
        "Speculative decoding: draft tokens accepted (usage counts only accepted and sampled tokens)",
        lambda s: s.spec_accepted_tokens,
        model_label=True,
    ),
    _Family(
        _COUNTER,
        "kvfence_spec_decode_num_accepted_tokens_per_pos",
        "Speculative decoding: draft tokens accepted, by their position in the draft (0: the first)",
        lambda s: {str(i): n for i, n in enumerate(s.spec_accepted_per_position)},
        "position",
        model_label=True,
    ),
    *(
        _Family(
            _COUNTER,
            f"kvfence_kv_tier_{what}",
            f"KV tiers: {doc}, by tier",
            lambda s, what=what: s.kv_tier.get(what, {}),
            "tier",
        )
        for what, doc in (
            ("lookups", "pages looked up"),
            ("hits", "pages restored (a value that opened under the tenant's key for this model and place)"),
            ("misses", "pages not found, or found and not opening"),
            ("stores", "pages stored by the writer"),
            ("evictions", "entries evicted to stay within the tier's size"),
            ("errors", "store operations that failed (a miss or a dropped store)"),
            ("skipped", "store operations not tried: the store failed within the last few seconds"),
            ("dropped", "pages not stored: the writer's queue was full (the step never waits)"),
            ("stale", "pages not stored: reallocated before the writer copied them (the fence's generation)"),
        )
    ),
    _Family(
        _COUNTER,
        "kvfence_kv_tier_rejected",
        "KV tiers: values found that did not open (tampered, truncated, another tenant's, model's or "
        "layout's), by reason",
        lambda s: s.kv_tier.get("rejected", {}),
        "reason",
    ),
    *(
        _Family(_COUNTER, f"kvfence_{name}", doc, value, model_label=True)
        for name, doc, value in (
            (
                "prefix_cache_query_tokens",
                "Prompt tokens looked up in the pool's prefix cache",
                lambda s: s.prefix_query_tokens,
            ),
            (
                "prefix_cache_hit_tokens",
                "Prompt tokens found in the pool's prefix cache",
                lambda s: s.prefix_hit_tokens,
            ),
            (
                "kv_tier_query_tokens",
                "Prompt tokens looked up in the KV tiers",
                lambda s: s.tier_query_tokens,
            ),
            ("kv_tier_hit_tokens", "Prompt tokens restored from the KV tiers", lambda s: s.tier_hit_tokens),
        )
    ),
    _Family(
        _COUNTER,
        "kvfence_num_preemptions",
        "Requests preempted when the KV pool ran out of pages: their pages released, they restart later "
        "from their tokens (recompute)",
        lambda s: s.num_preemptions,
        model_label=True,
    ),
    _HistogramFamily(
        HistogramMetricFamily,
        "kvfence_iteration_tokens",
        "Tokens per engine step: prompt tokens computed (prefix-cache hits excluded) plus tokens generated",
        lambda s: (s.iteration_tokens, s.iteration_tokens_sum),
        model_label=True,
        bounds=ITERATION_BUCKETS,
    ),
    _Family(
        _GAUGE,
        "kvfence_kv_tier_bytes",
        "KV tiers: bytes held, by tier",
        lambda s: s.kv_tier.get("bytes", {}),
        "tier",
    ),
    _Family(
        _COUNTER,
        "kvfence_transport_rejected",
        "Frames between router and workers dropped before being acted on, by reason",
        lambda s: s.transport_rejected,
        "reason",
        pools_only=False,
    ),
)


class _EngineCollector:
    """Prometheus collector for the engine's own counters and gauges, read at scrape time."""

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self._engine = engine
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine.stats()
        return (family.collect(stats, self._model_name) for family in _ENGINE_FAMILIES)


# Token-count buckets (vLLM's 1-2-5 series), cut at the window by `_length_buckets`.
_LENGTHS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
_PHASE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


def _length_buckets(max_model_len: int) -> tuple[float, ...]:
    return (*(b for b in _LENGTHS if b < max_model_len), max_model_len)


class Metrics:
    """The app's metrics, in a registry of their own (so several apps can live in one process). Every
    request-level series carries the served model's name (`model_name`), as vLLM's do."""

    def __init__(
        self, engine: EngineClient, model_name: str, max_model_len: int = 2**20, compat: str | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        self._compat = CollectorRegistry(auto_describe=False) if compat == "vllm" else None
        if self._compat is not None:
            self._compat.register(_VllmNames(self.registry))
        r, model = self.registry, ["model_name"]
        lengths = _length_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, model, registry=r, buckets=buckets).labels(model_name)

        self.requests = Counter(
            "kvfence_requests", "Requests by final status", ["status", *model], registry=r
        )
        self.finished = Counter(
            "kvfence_request_success",
            "Requests that finished normally, by finish reason (stop, length)",
            ["finished_reason", *model],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvfence_prompt_tokens", "Prompt tokens of admitted requests", model, registry=r
        ).labels(model_name)
        self.generation_tokens = Counter(
            "kvfence_generation_tokens", "Tokens generated", model, registry=r
        ).labels(model_name)
        self.embedding_requests = Counter(
            "kvfence_embedding_requests", "Embedding requests answered", model, registry=r
        ).labels(model_name)
        self.embedding_tokens = Counter(
            "kvfence_embedding_prompt_tokens", "Input tokens of answered embeddings", model, registry=r
        ).labels(model_name)
        self.rejections = Counter(
            "kvfence_admission_rejections", "Requests refused at admission, by reason", ["reason"], registry=r
        )
        self.ttft = histogram(
            "kvfence_time_to_first_token_seconds",
            "Arrival to first generated token",
            (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tpot = histogram(
            "kvfence_time_per_output_token_seconds",
            "Mean time per token after the first",
            (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.e2e_latency = histogram(
            "kvfence_e2e_request_latency_seconds",
            "Arrival to the last token, of requests that finished normally",
            (0.3, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600),
        )
        self.prompt_lengths = histogram(
            "kvfence_request_prompt_tokens", "Prompt tokens per request that finished normally", lengths
        )
        self.generation_lengths = histogram(
            "kvfence_request_generation_tokens",
            "Tokens generated per request that finished normally",
            lengths,
        )
        self.max_generation = histogram(
            "kvfence_request_max_num_generation_tokens",
            "The longest choice's tokens, per request that finished normally (n > 1: its longest fork)",
            lengths,
        )
        self.phases = [
            histogram(f"kvfence_request_{phase}_time_seconds", doc, _PHASE_BUCKETS)
            for phase, doc in (
                ("queue", "Arrival to first scheduled"),
                ("prefill", "First scheduled to first token"),
                ("decode", "First token to last token"),
                ("inference", "First scheduled to last token"),
            )
        ]
        self._model_name = model_name
        r.register(_EngineCollector(engine, model_name))

    def exposition(self) -> bytes:
        """The scrape: kvfence's series, then (`compat` "vllm") vLLM's under its own names. Blocking: it
        reads the engine's stats."""
        text = generate_latest(self.registry)
        return text if self._compat is None else text + generate_latest(self._compat)

    def embedded(self, tokens: int) -> None:
        """An embedding request answered, of `tokens` input tokens."""
        self.embedding_requests.inc()
        self.embedding_tokens.inc(tokens)

    async def observe(self, outputs: _Outputs) -> _Outputs:
        """Pass `outputs` through, recording the request once however it ends (closing this closes
        `outputs`, which aborts the engine request). With n > 1 the outputs are the forks': tokens are
        counted over every fork, the prompt once."""
        arrived, first_token_at, status = time.monotonic(), None, "aborted"
        last: dict[str, RequestOutput] = {}  # by request id: one per fork with n > 1
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    if first_token_at is None and output.new_token_ids:
                        first_token_at = time.monotonic()
                        self.ttft.observe(first_token_at - arrived)
                    last[output.request_id] = output
                    if all(o.finished for o in last.values()):
                        status = _status(last.values())
                        if status == Status.FINISHED.value:  # at its last token, not when the client is done
                            self.e2e_latency.observe(time.monotonic() - arrived)
                    yield output
        except AdmissionError as exc:
            status = Status.REJECTED.value
            self.rejections.labels(exc.code).inc()
            raise
        finally:
            self._record(status, list(last.values()), first_token_at)

    def _record(self, status: str, last: list[RequestOutput], first_token_at: float | None) -> None:
        self.requests.labels(status, self._model_name).inc()
        if not last:
            return
        self.prompt_tokens.inc(last[0].prompt_tokens)
        self.generation_tokens.inc(sum(o.completion_tokens for o in last))
        longest = max(o.completion_tokens for o in last)  # forks decode side by side, a token each a step
        if first_token_at is not None and longest > 1:
            self.tpot.observe((time.monotonic() - first_token_at) / (longest - 1))
        if status == Status.FINISHED.value:
            self._record_finished(last, longest)

    def _record_finished(self, last: list[RequestOutput], longest: int) -> None:
        """vLLM's per-request series, for a request that finished normally."""
        for output in last:
            self.finished.labels(output.finish_reason or "stop", self._model_name).inc()
        self.prompt_lengths.observe(last[0].prompt_tokens)
        self.generation_lengths.observe(sum(o.completion_tokens for o in last))
        self.max_generation.observe(longest)
        phases = next((o.phases for o in last if o.phases is not None), None)
        if phases is not None:  # the router's outputs do not carry the engine's times
            queue, prefill, decode = phases
            for histogram, seconds in zip(
                self.phases, (queue, prefill, decode, prefill + decode), strict=True
            ):
                histogram.observe(seconds)


# vLLM's series under kvfence's names (without the kvfence_ prefix) -> vLLM's names for them.
VLLM_NAMES = {
    "num_requests_running": ["vllm:num_requests_running"],
    "num_requests_waiting": ["vllm:num_requests_waiting"],
    "kv_cache_usage_ratio": ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],  # new name, old one
    "e2e_request_latency_seconds": ["vllm:e2e_request_latency_seconds"],
    "prompt_tokens": ["vllm:prompt_tokens"],
    "generation_tokens": ["vllm:generation_tokens"],
    "time_to_first_token_seconds": ["vllm:time_to_first_token_seconds"],
    "time_per_output_token_seconds": [
        "vllm:time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
    ],
    "request_success": ["vllm:request_success"],
    "request_prompt_tokens": ["vllm:request_prompt_tokens"],
    "request_generation_tokens": ["vllm:request_generation_tokens"],
    "request_max_num_generation_tokens": ["vllm:request_max_num_generation_tokens"],
    "request_queue_time_seconds": ["vllm:request_queue_time_seconds"],
    "request_prefill_time_seconds": ["vllm:request_prefill_time_seconds"],
    "request_decode_time_seconds": ["vllm:request_decode_time_seconds"],
    "request_inference_time_seconds": ["vllm:request_inference_time_seconds"],
    "prefix_cache_query_tokens": ["vllm:prefix_cache_queries"],
    "prefix_cache_hit_tokens": ["vllm:prefix_cache_hits"],
    "kv_tier_query_tokens": ["vllm:external_prefix_cache_queries"],
    "kv_tier_hit_tokens": ["vllm:external_prefix_cache_hits"],
    "spec_decode_num_drafts": ["vllm:spec_decode_num_drafts"],
    "spec_decode_num_draft_tokens": ["vllm:spec_decode_num_draft_tokens"],
    "spec_decode_num_accepted_tokens": ["vllm:spec_decode_num_accepted_tokens"],
    "spec_decode_num_accepted_tokens_per_pos": ["vllm:spec_decode_num_accepted_tokens_per_pos"],
    "num_preemptions": ["vllm:num_preemptions"],
    "iteration_tokens": ["vllm:iteration_tokens_total"],  # vLLM's histogram, named as a counter would be
}


class _VllmNames:
    """`--metrics-compat vllm`: each of vLLM's series in `source` again under vLLM's name, same samples."""

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            for name in VLLM_NAMES.get(family.name.removeprefix("kvfence_"), []):
                renamed = Metric(name, family.documentation, family.type)
                renamed.samples = [
                    sample._replace(name=name + sample.name[len(family.name) :]) for sample in family.samples
                ]
                yield renamed


def _status(finished: Iterable[RequestOutput]) -> str:
    """A request's status from its outputs' (its forks'): finished only if every one finished."""
    statuses = [o.status for o in finished]
    return next((s for s in statuses if s is not Status.FINISHED), Status.FINISHED).value
