"""Load with faults, run end to end: the real server over one engine (single node) or the Router in front
of a prefill and a decode worker process (disaggregated), driven by the load generator, then drained and
judged. What bench/stress.py reports and tests/integration/test_stress.py asserts.

Contracts: a run is bounded by `Plan.time_limit_s` (plus bounded drains); the cluster is always stopped;
the report's `problems` (judge.py) is empty exactly when every rule held. Single node, fault effects are
judged by a FaultLedger on the engine; disaggregated, worker faults live in other processes, so the
report counts what the audit trails show (fault_injected events, integrity aborts).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvfence.cache.pool import PageState
from kvfence.config import EngineConfig
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.judge import (
    RunReport,
    canary_leaks,
    drain_problems,
    fault_problems,
    fault_summary,
    health_problems,
    judge_outcomes,
    received_ok_by_request,
)
from kvfence.harness.ledger import FaultLedger
from kvfence.harness.load import MODEL, Job, Outcome, Shape, Tenant, drive, make_jobs, make_tenants
from kvfence.harness.references import EXACT, Reference, compute_references, reference_engine
from kvfence.harness.server import metric
from kvfence.harness.workers import Spawned
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.trail.reasons import INTEGRITY_REASONS

ADMIN_KEY = "stress-admin"
# Single-node fault rates per injection-point call (steps, page takes, releases, admissions, lookups).
FAULT_RATES = {
    "stale_write": 0.02,
    "double_allocation": 0.002,
    "stale_mapping": 0.02,
    # asked on each admission without a prefix hit: few while the tenants' preambles stay cached, most when a
    # fast run's full pool evicts them; so kept low, or nearly every hang-up is aborted before it hangs up
    "read_beyond_written": 0.08,
    "cross_tenant_prefix_hit": 0.03,
}
# Disaggregated: transfer faults on the prefill worker, page faults in the decode worker's engine.
PREFILL_FAULT_RATES = {"corrupt_page": 0.03, "partial_transfer": 0.03, "transfer_failure_ack_mismatch": 0.03}
DECODE_FAULT_RATES = {"stale_write": 0.01, "double_allocation": 0.002, "stale_mapping": 0.02}


@dataclass(frozen=True)
class Plan:
    clients: int
    requests: int
    tenants: int
    window: int
    num_pages: int
    max_tokens: int
    cancel_rate: float
    fault_scale: float
    time_limit_s: float
    seed: int

    def limits(self) -> Shape:
        return Shape(self.window, 16, self.max_tokens)


def scaled(rates: dict[str, float], scale: float) -> dict[str, float]:
    return {name: min(1.0, rate * scale) for name, rate in rates.items() if rate * scale > 0}


def serving_engine(gguf: GGUFModel, window: int, num_pages: int, faults: dict[str, float]) -> LLMEngine:
    config = EngineConfig(
        num_pages=num_pages, max_model_len=window, faults=faults, max_num_seqs=64, activation_dtype=EXACT
    )
    model = Transformer.from_gguf(gguf, activation_dtype=EXACT)
    return LLMEngine(config, model, Tokenizer.from_gguf(gguf), log=lambda _: None)


def tenant_keys(tenants: list[Tenant]) -> dict[str, str]:
    return {t.key: t.name for t in tenants}


def _workload(
    gguf: GGUFModel, plan: Plan, seed: int, refs_engine: LLMEngine | None
) -> tuple[Tokenizer, list[Tenant], list[Job], dict[int, Reference]]:
    """The plan's tenants and jobs, and the offline reference of every servable job."""
    tokenizer = Tokenizer.from_gguf(gguf)
    tenants = make_tenants(plan.tenants, plan.seed)
    jobs = make_jobs(tokenizer, tenants, plan.requests, plan.limits(), plan.cancel_rate, seed)
    refs = compute_references(refs_engine or reference_engine(gguf, plan.window), jobs)
    return tokenizer, tenants, jobs, refs


# ---- single node ---------------------------------------------------------------------------------------


def engine_drain_state(engine: LLMEngine) -> dict[str, Any]:
    """On the engine thread: the allocator's own integrity check, and where every page is now."""
    allocator, pool = engine.allocator, engine.pool
    try:
        engine.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"FAILED: {exc}"
    cached = set(engine.prefix.hash_by_page) if engine.prefix else set()
    scheduler = engine.scheduler
    return {
        "integrity": integrity,
        "num_pages": pool.num_pages,
        "pages_free": allocator.num_free_pages,
        "referenced_pages": int(np.count_nonzero(allocator.refcount)),
        "quarantined_pages": int(np.count_nonzero(pool.state == PageState.QUARANTINED)),
        "owned_uncached_pages": int(
            sum(1 for p in np.flatnonzero(pool.state == PageState.OWNED) if p not in cached)
        ),
        "live_requests": len(engine.requests) + len(scheduler.quarantined) + len(scheduler.transferring),
        "stale_releases": allocator.stale_releases,
    }


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(every_s)
    return False


def run_single_node(
    gguf: GGUFModel, plan: Plan, refs_engine: LLMEngine | None = None, rates: dict[str, float] = FAULT_RATES
) -> RunReport:
    """The real server over one engine with single-node faults armed at `plan.fault_scale` x `rates`."""
    tokenizer, tenants, jobs, refs = _workload(gguf, plan, plan.seed, refs_engine)
    engine = serving_engine(gguf, plan.window, plan.num_pages, scaled(rates, plan.fault_scale))
    ledger = FaultLedger.attach(engine)
    with cluster(engine, api_keys=tenant_keys(tenants), admin_key=ADMIN_KEY, model_name=MODEL) as running:
        started = time.monotonic()
        outcomes, health = asyncio.run(drive(running.url, jobs, plan.clients, plan.time_limit_s))
        wall = time.monotonic() - started
        drain = asyncio.run(_single_node_drain(running.url, running.engine))
    report = RunReport("single", wall, outcomes, health, drain)
    report.problems = judge_outcomes(jobs, outcomes, refs, tokenizer)
    report.faults = fault_summary(ledger, received_ok_by_request(outcomes, refs))
    report.leaks = canary_leaks(jobs, outcomes, tenants)
    report.problems += drain_problems(drain) + fault_problems(report.faults) + report.leaks
    report.problems += health_problems(health)
    return report


async def _single_node_drain(base: str, engine: AsyncEngine, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait (bounded) until nothing holds a page, then read the pool on the engine thread and /metrics."""
    num_pages = engine.engine.pool.num_pages

    async def idle() -> bool:
        free = await asyncio.to_thread(metric, base, "kvfence_pages_free", None, ADMIN_KEY)
        return free == num_pages

    await wait_until(idle, timeout_s)
    drain = await asyncio.wrap_future(engine.call(lambda: engine_drain_state(engine.engine)))
    drain["metrics_pages_free"] = await asyncio.to_thread(metric, base, "kvfence_pages_free", None, ADMIN_KEY)
    return drain


# ---- disaggregated -------------------------------------------------------------------------------------


def disagg_configs(plan: Plan) -> tuple[EngineConfig, EngineConfig]:
    """Both pools hold the window (so only the window refuses), one torch thread per worker, the exact
    path (their completions are compared with references)."""
    prefill = EngineConfig(
        num_pages=plan.num_pages,
        max_model_len=plan.window,
        num_threads=1,
        activation_dtype=EXACT,
        faults=scaled(PREFILL_FAULT_RATES, plan.fault_scale),
    )
    decode = replace(
        prefill, faults=scaled(DECODE_FAULT_RATES, plan.fault_scale), enable_prefix_caching=False
    )
    return prefill, decode


def run_disaggregated(
    gguf: GGUFModel, plan: Plan, refs_engine: LLMEngine | None = None, workers: tuple[int, int] = (1, 1)
) -> RunReport:
    """The same load through the Router in front of `workers` = (prefill, decode) worker processes."""
    tokenizer, tenants, jobs, refs = _workload(gguf, plan, plan.seed + 1, refs_engine)
    configs = zip(disagg_configs(plan), workers, strict=True)
    prefill, decode = ([Spawned(config) for _ in range(n)] for config, n in configs)
    with cluster(
        prefill=prefill, decode=decode, api_keys=tenant_keys(tenants), admin_key=ADMIN_KEY, model_name=MODEL
    ) as running:
        started = time.monotonic()
        outcomes, health = asyncio.run(drive(running.url, jobs, plan.clients, plan.time_limit_s))
        wall = time.monotonic() - started
        drain = asyncio.run(_cluster_drain(running))
        faults = trail_fault_summary(running, outcomes)
    report = RunReport("disagg", wall, outcomes, health, drain, faults)
    report.problems = judge_outcomes(jobs, outcomes, refs, tokenizer)
    report.leaks = canary_leaks(jobs, outcomes, tenants)
    report.problems += drain_problems(drain) + report.leaks
    report.problems += health_problems(health)
    return report


async def _cluster_drain(running: Cluster, timeout_s: float = 60.0) -> dict[str, Any]:
    """Every worker idle (bounded wait); their pools summed as the router's /metrics shows them."""

    async def idle() -> bool:
        stats = [await asyncio.to_thread(running.worker_stats, name) for name in running.workers]
        return all(s.pages_free == s.num_pages and not s.pages_by_state["quarantined"] for s in stats)

    await wait_until(idle, timeout_s, every_s=0.5)
    stats = [await asyncio.to_thread(running.worker_stats, name) for name in running.workers]
    return {
        "num_pages": sum(s.num_pages for s in stats),
        "pages_free": sum(s.pages_free for s in stats),
        "quarantined_pages": sum(s.pages_by_state["quarantined"] for s in stats),
        "metrics_pages_free": await asyncio.to_thread(
            metric, running.url, "kvfence_pages_free", None, ADMIN_KEY
        ),
        "note": "allocator.check_integrity() cannot be run remotely: workers answer stats only",
    }


def trail_fault_summary(running: Cluster, outcomes: list[Outcome]) -> dict[str, Any]:
    """Worker faults are counted in the workers' processes; what the harness can see is the audit trail:
    fault_injected events and integrity aborts of the requests that did not complete."""
    injected: Counter[str] = Counter()
    aborts: Counter[str] = Counter()
    for outcome in outcomes:
        if outcome.request_id is None or outcome.kind in ("completed", "rejected"):
            continue
        for event in running.router.audit_events(outcome.request_id):
            if event["kind"] == "fault_injected":
                injected[event["fault"]] += 1
            elif event["kind"] == "aborted" and event.get("reason") in INTEGRITY_REASONS:
                aborts[event["reason"]] += 1
    return {"fault_injected_events": dict(injected), "integrity_aborts_on_trails": dict(aborts)}
