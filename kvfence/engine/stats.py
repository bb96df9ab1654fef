"""Engine counters read together (on the engine's own thread), for /metrics and for workers' replies.

`pages_free` is what an allocation can take now: FREE pages plus cached prefix pages no request holds (they
stay OWNED by their tenant, so only that tenant can hit them, and are evicted on demand); hence it exceeds
`pages_by_state["free"]` by the idle prefix cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfence.cache.pool import PageState
from kvfence.engine.engine import LLMEngine
from kvfence.trail.reasons import INTEGRITY_REASONS


@dataclass(frozen=True)
class EngineStats:
    num_pages: int
    pages_free: int
    pages_by_state: dict[str, int]
    prefix_hits: int
    integrity_aborts: dict[str, int]
    refused_writes: int
    validation_checks: int
    validation_seconds: float
    # Frames a disaggregated node dropped before acting on them, by reason (empty on a single node).
    transport_rejected: dict[str, int] = dataclasses.field(default_factory=dict)
    # Requests the scheduler steps (prefill or decode) and those queued for admission; a disaggregated
    # worker's requests whose KV is in transit are in neither. Defaults keep older positional callers.
    num_running: int = 0
    num_waiting: int = 0
    # Speculative decoding (drafter.SpecStats): verifications, draft tokens verified and accepted, accepted
    # by draft position.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    # KV tiers (cache/tiers.py KVTiers.totals): counts by metric and tier label; empty without tiers.
    kv_tier: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # vLLM's prefix-cache series count tokens: those looked up and found in the pool's prefix cache, and
    # (its "external" ones) in the KV tiers below it.
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    tier_query_tokens: int = 0
    tier_hit_tokens: int = 0
    # Prompt tokens computed (prefix-cache hits excluded) and tokens generated, since the engine started.
    prompt_tokens_computed: int = 0
    generation_tokens: int = 0
    # Requests preempted (recompute: pages released, restarted later), and the steps by tokens computed and
    # generated (iteration.py: counts per bucket of ITERATION_BUCKETS, +Inf last, and their sum).
    num_preemptions: int = 0
    iteration_tokens: list[int] = dataclasses.field(default_factory=list)
    iteration_tokens_sum: int = 0

    @property
    def pages_held(self) -> int:
        """Pages some request or transfer holds: neither free nor cached-and-idle."""
        return self.num_pages - self.pages_free

    @classmethod
    def read(cls, engine: LLMEngine, transport_rejected: Mapping[str, int] | None = None) -> EngineStats:
        counts = np.bincount(engine.pool.state, minlength=len(PageState))
        fence, spec, tiers = engine.fence.stats, engine.spec_stats, engine.kv_cache.tiers
        tier_totals, page_size = tiers.totals() if tiers is not None else {}, engine.pool.page_size
        return cls(
            num_pages=engine.pool.num_pages,
            pages_free=engine.allocator.num_free_pages,
            pages_by_state={state.name.lower(): int(counts[state]) for state in PageState},
            prefix_hits=engine.prefix.hits if engine.prefix else 0,
            integrity_aborts={r: engine.integrity_aborts[r] for r in sorted(INTEGRITY_REASONS)},
            refused_writes=engine.pool.refused_writes,
            validation_checks=fence.checks,
            validation_seconds=fence.seconds,
            transport_rejected=dict(transport_rejected or {}),
            num_running=len(engine.scheduler.running),
            num_waiting=len(engine.scheduler.waiting),
            spec_drafts=spec.drafts,
            spec_draft_tokens=spec.draft_tokens,
            spec_accepted_tokens=spec.accepted_tokens,
            spec_accepted_per_position=list(spec.accepted_per_position),
            kv_tier=tier_totals,
            prefix_query_tokens=(engine.prefix.queries if engine.prefix else 0) * page_size,
            prefix_hit_tokens=(engine.prefix.hits if engine.prefix else 0) * page_size,
            tier_query_tokens=sum(tier_totals.get("lookups", {}).values()) * page_size,
            tier_hit_tokens=sum(tier_totals.get("hits", {}).values()) * page_size,
            prompt_tokens_computed=engine.prompt_tokens_computed,
            generation_tokens=engine.generation_tokens,
            num_preemptions=engine.scheduler.num_preemptions,
            iteration_tokens=list(engine.step_tokens.counts),
            iteration_tokens_sum=engine.step_tokens.total,
        )

    @classmethod
    def transport_only(cls, transport_rejected: Mapping[str, int]) -> EngineStats:
        """No pool, only dropped frames: what a router reports of itself."""
        return cls(0, 0, {}, 0, {}, 0, 0, 0.0, dict(transport_rejected))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineStats:
        return cls(**data)
