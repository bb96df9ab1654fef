"""Load with faults: many concurrent clients of several tenants against the real server, with client
cancellations mid-stream and fault injection, single node and disaggregated (Router + worker processes).

    .venv/bin/python bench/stress.py [--mode single|disagg|both] [--clients 64] [--requests 256]
                                     [--tenants 4] [--cancel-rate 0.2] [--fault-scale 1.0]
                                     [--time-limit 900] [--seed 0]

Every prompt is token ids of exact length: short ones, ones on page boundaries, ones exactly at the
context window (prompt + max_tokens == window: must complete) and just beyond it (must be refused with
400 before anything is reserved). Each tenant's prompts start with its own canary. Every request is
greedy with ignore_eos and a fixed max_tokens, so its output is fully determined by its prompt.

At the end it reports and checks (RunReport.problems lists every rule broken): every completed request
equals its solo reference (computed offline by a separate engine; a divergence is accepted only at a
near-tie of the reference's top-2 logits, as in the golden tests); every other request ended with a clear
error (400 rejection, 500 kv_integrity_error, 503 retry-later: retried after a pause, up to RETRY_ATTEMPTS
times) or the client's own cancellation; no tenant's canary in another tenant's output; every fault that
took effect was caught (single node: see fault_effects.py; the disaggregated run counts what the audit
trails show); after the drain every page is free or cached with no reference, nothing quarantined, the
allocator consistent; and /health answered throughout. Prints a table and writes
bench/results/stress.json. Loopback only; the load is bounded by --requests and --time-limit. One torch
thread by default (--threads): clients, server and engine share this process, and OpenMP threads spinning
against them (or anything else on a 2-core machine) slowed steps by up to 10x here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import httpx
import numpy as np
import torch
from common import WORDS, load_weights, print_table, write_json
from fault_effects import FaultLedger
from serving import Cluster, metric, serve, start_cluster

from kvfence.api.server import build_app
from kvfence.cache.pool import PageState
from kvfence.config import EngineConfig
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.model.gguf import GGUFModel
from kvfence.model.llama import LlamaModel
from kvfence.model.tokenizer import IncrementalDecoder, Tokenizer
from kvfence.request import Request
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import INTEGRITY_REASONS
from kvfence.units import cdiv

MODEL = "smollm2-stress"
ADMIN_KEY = "stress-admin"
TIE_GAP = 1e-3  # a reference step whose top-2 logits are closer than this may flip under batching
REQUEST_TIMEOUT_S = 180.0  # a request still unanswered after this is a hang (kind "timeout")
HEALTH_EVERY_S = 0.25
HEALTH_TIMEOUT_S = 5.0
# Idle pooled connections are dropped well before uvicorn's 5 s keep-alive: a request sent on a connection
# the server is closing fails with a ReadError that says nothing about the server.
KEEPALIVE_S = 1.0
CANARY_WORDS = (
    "ZORBLAX",
    "QUINTAVEX",
    "MERIDOCK",
    "FLENVARI",
    "TOSKELUM",
    "VARNIQUE",
    "DELPHORAX",
    "KYRENTIL",
)
# Single-node fault rates per injection-point call (steps, page takes, releases, admissions, lookups).
FAULT_RATES = {
    "stale_write": 0.02,
    "double_allocation": 0.002,
    "stale_mapping": 0.02,
    "read_beyond_written": 0.25,  # asked only on admissions without a prefix hit: rare
    "cross_tenant_prefix_hit": 0.03,
}
# Disaggregated: transfer faults on the prefill worker, page faults in the decode worker's engine.
PREFILL_FAULT_RATES = {"corrupt_page": 0.03, "partial_transfer": 0.03, "transfer_failure_ack_mismatch": 0.03}
DECODE_FAULT_RATES = {"stale_write": 0.01, "double_allocation": 0.002, "stale_mapping": 0.02}
RETRY_LATER = frozenset({"server_busy", "prefill_unavailable", "decode_unavailable"})  # 503: never started
RETRY_ATTEMPTS = 30
RETRY_PAUSE_S = 0.5

# ---- tenants and jobs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str
    canary: str  # appears in every prompt of this tenant, and must never appear in another's output


def make_tenants(count: int, seed: int) -> list[Tenant]:
    """Up to len(CANARY_WORDS) tenants, each with its own canary word (no canary contains another)."""
    if count > len(CANARY_WORDS):
        raise ValueError(f"at most {len(CANARY_WORDS)} tenants")
    rng = random.Random(f"tenants-{seed}")
    words = rng.sample(CANARY_WORDS, count)
    return [
        Tenant(f"tenant-{i}", f"key-{i}", f"{words[i]}-{rng.randrange(1000, 9999)}") for i in range(count)
    ]


@dataclass(frozen=True)
class Job:
    index: int
    tenant: Tenant
    shape: str  # which length class: short, page_edge, medium, at_window, over_window, over_prompt, single
    prompt: list[int]
    max_tokens: int
    stream: bool
    cancel_after: int | None  # content chunks read before the client hangs up; None: read to the end
    window: int

    @property
    def must_reject(self) -> bool:
        return len(self.prompt) + self.max_tokens > self.window


@dataclass(frozen=True)
class Shape:
    """Prompt lengths are drawn relative to the window, the page size and the tenant preamble."""

    window: int
    page_size: int
    max_tokens: int  # the largest max_tokens a job asks for


SHAPES = (
    ("short", 4),
    ("page_edge", 3),
    ("medium", 3),
    ("at_window", 1),
    ("over_window", 1),
    ("over_prompt", 1),
    ("single", 1),
)


def _filler(rng: random.Random, words: int) -> str:
    return " ".join(rng.choices(WORDS, k=words))


def tenant_prompt(tokenizer: Tokenizer, tenant: Tenant, length: int, rng: random.Random) -> list[int]:
    """Exactly `length` token ids: the tenant's preamble (with its canary) then seeded filler. Prompts of a
    tenant share the preamble's pages in the prefix cache; shorter than the preamble, it is cut."""
    preamble = f"Private notes of {tenant.name}. The access code is {tenant.canary}; never share it."
    text, ids = preamble, tokenizer.encode(preamble, add_special_tokens=True)
    while len(ids) < length:
        text += f" Note {rng.randrange(10**6)}: {_filler(rng, 24)}."
        ids = tokenizer.encode(text, add_special_tokens=True)
    return ids[:length]


def _length(shape: str, limits: Shape, max_tokens: int, preamble: int, rng: random.Random) -> int:
    window, ps = limits.window, limits.page_size
    if shape == "short":
        return rng.randint(preamble + 1, preamble + 2 * ps)
    if shape == "page_edge":
        pages = rng.randint(cdiv(preamble, ps) + 1, max(cdiv(preamble, ps) + 1, (window - max_tokens) // ps))
        return min(pages * ps + rng.choice((-1, 0, 1)), window - max_tokens)
    if shape == "medium":
        return rng.randint(preamble + 1, max(preamble + 1, (window - max_tokens) // 2))
    if shape == "at_window":
        return window - max_tokens
    if shape == "over_window":
        return window - max_tokens + 1
    if shape == "over_prompt":
        return window + rng.randint(1, 2 * ps)
    return 1  # single: one token, no transfer in disaggregated mode


def make_jobs(
    tokenizer: Tokenizer, tenants: list[Tenant], count: int, limits: Shape, cancel_rate: float, seed: int
) -> list[Job]:
    """`count` jobs spread evenly over tenants, shapes drawn by SHAPES' weights; `cancel_rate` of the
    servable ones stream and hang up mid-stream, half of the rest stream to the end."""
    rng = random.Random(f"jobs-{seed}")
    names, weights = zip(*SHAPES, strict=True)
    preamble = len(tenant_prompt(tokenizer, tenants[0], 0, rng))
    jobs = []
    for index in range(count):
        tenant, shape = tenants[index % len(tenants)], rng.choices(names, weights)[0]
        max_tokens = rng.randint(2, limits.max_tokens)
        length = _length(shape, limits, max_tokens, preamble, rng)
        prompt = tenant_prompt(tokenizer, tenant, length, rng)
        servable = length + max_tokens <= limits.window
        cancel = servable and rng.random() < cancel_rate
        stream = cancel or rng.random() < 0.5
        cancel_after = rng.randint(1, max_tokens - 1) if cancel else None
        jobs.append(Job(index, tenant, shape, prompt, max_tokens, stream, cancel_after, limits.window))
    return jobs


# ---- references ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    text: str
    gaps: list[float]  # top-2 logit gap of each sampled step


def reference_engine(gguf: GGUFModel, window: int) -> LLMEngine:
    """A separate cold engine: no prefix cache, no faults, a pool for a few windows."""
    pages = cdiv(window, 16) * 8
    config = EngineConfig(num_pages=pages, max_model_len=window, enable_prefix_caching=False)
    model = LlamaModel.from_gguf(gguf)
    return LLMEngine(config, model, Tokenizer.from_gguf(gguf), log=lambda _: None)


def compute_references(engine: LLMEngine, jobs: list[Job], batch: int = 8) -> dict[int, Reference]:
    """Greedy outputs of every servable job (deduplicated by prompt and length), `batch` at a time on a
    cold engine: batched equals solo up to near-ties (tests/test_golden.py), which `compare` allows."""
    gaps: dict[str, list[float]] = {}

    def observe(requests: list[Request], logits: torch.Tensor) -> None:
        top2 = torch.topk(logits, 2, dim=-1).values
        for request, (a, b) in zip(requests, top2.tolist(), strict=True):
            gaps.setdefault(request.request_id, []).append(a - b)

    engine.runner.logits_observer = observe
    unique: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for job in jobs:
        if not job.must_reject:
            unique.setdefault((tuple(job.prompt), job.max_tokens), []).append(job.index)
    keys = list(unique)
    refs: dict[int, Reference] = {}
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in chunk]
        for key, request in zip(chunk, engine.generate([list(p) for p, _ in chunk], params), strict=True):
            ref = Reference(request.output_token_ids, request.output_text, gaps.pop(request.request_id))
            refs.update(dict.fromkeys(unique[key], ref))
    return refs


def compare(reference: Reference, text: str, tokenizer: Tokenizer) -> str:
    """'exact', 'near_tie' (the texts part where the reference's top-2 gap is below TIE_GAP), or
    'differs'."""
    if text == reference.text:
        return "exact"
    decoder, seen = IncrementalDecoder(tokenizer), ""
    for step, token in enumerate(reference.tokens):
        seen += decoder.step(token)
        if not text.startswith(seen):
            return "near_tie" if reference.gaps[step] < TIE_GAP else "differs"
    return "differs"


# ---- clients -------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    job: int
    kind: str  # completed | rejected | integrity | retry_later | cancelled | error | timeout | skipped
    status: int | None = None
    request_id: str | None = None
    text: str = ""
    error_type: str | None = None
    error_code: str | None = None
    seconds: float = 0.0
    match: str | None = None  # for completed: exact | near_tie | differs
    attempts: int = 1  # a 503 "retry later" is retried after a pause, as a client would
    retry_after: str | None = None  # the Retry-After header of an error answer


def _error_kind(status: int, error: dict[str, Any]) -> str:
    if error.get("type") == "kv_integrity_error":
        return "integrity"
    if error.get("code") in RETRY_LATER:
        return "retry_later"  # judged below: it must come as a 503
    if status == 400:
        return "rejected"
    return "error"


def _body(job: Job) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": job.prompt,
        "max_tokens": job.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": job.stream,
    }


async def _plain(client: httpx.AsyncClient, url: str, job: Job, outcome: Outcome) -> None:
    response = await client.post(url, json=_body(job), headers={"authorization": f"Bearer {job.tenant.key}"})
    _set_head(outcome, response)
    data = response.json()
    if response.status_code == 200:
        outcome.kind, outcome.text = "completed", data["choices"][0]["text"]
        return
    _set_error(outcome, response.status_code, data.get("error", {}))


def _set_head(outcome: Outcome, response: httpx.Response) -> None:
    outcome.status, outcome.request_id = response.status_code, response.headers.get("x-request-id")
    outcome.retry_after = response.headers.get("retry-after")


def _set_error(outcome: Outcome, status: int, error: dict[str, Any]) -> None:
    outcome.kind = _error_kind(status, error)
    outcome.error_type, outcome.error_code = error.get("type"), error.get("code")


async def _streamed(
    client: httpx.AsyncClient,
    url: str,
    job: Job,
    outcome: Outcome,
    on_chunk: Callable[[], None] | None = None,
) -> None:
    headers = {"authorization": f"Bearer {job.tenant.key}"}
    async with client.stream("POST", url, json=_body(job), headers=headers) as response:
        _set_head(outcome, response)
        if response.status_code != 200:
            _set_error(outcome, response.status_code, json.loads(await response.aread()).get("error", {}))
            return
        await _read_events(response, job, outcome, on_chunk)


async def _read_events(
    response: httpx.Response, job: Job, outcome: Outcome, on_chunk: Callable[[], None] | None
) -> None:
    """Consume SSE events; hang up after `job.cancel_after` content chunks (leaving the `stream` block
    closes the connection mid-stream, which is the cancellation the server must handle)."""
    chunks = 0
    async for line in response.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line.removeprefix("data: "))
        if "error" in event:
            _set_error(outcome, 500, event["error"])  # an error event after a 200: the request failed
            return
        choice = event["choices"][0]
        outcome.text += choice["text"]
        chunks += 1
        if on_chunk is not None:
            on_chunk()
        if choice.get("finish_reason"):
            outcome.kind = "completed"
            return
        if job.cancel_after is not None and chunks >= job.cancel_after:
            outcome.kind = "cancelled"
            return
    outcome.kind = "error"  # the stream ended with neither a finish nor an error event


async def run_job(
    client: httpx.AsyncClient,
    base: str,
    job: Job,
    on_chunk: Callable[[], None] | None = None,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> Outcome:
    """One request, bounded by `timeout_s`; every way it can end is an Outcome, never an exception.
    `on_chunk` is called for each streamed content chunk (e.g. to know that decoding has started)."""
    outcome, started = Outcome(job.index, "error"), time.monotonic()
    url = f"{base}/v1/completions"
    call = _streamed(client, url, job, outcome, on_chunk) if job.stream else _plain(client, url, job, outcome)
    try:
        await asyncio.wait_for(call, timeout_s)
    except TimeoutError:
        outcome.kind = "timeout"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        outcome.kind, outcome.error_type = "error", type(exc).__name__
    outcome.seconds = time.monotonic() - started
    return outcome


@dataclass
class Health:
    polls: int = 0
    failures: int = 0
    max_latency_s: float = 0.0


async def poll_health(base: str, stop: asyncio.Event, health: Health) -> None:
    """GET /health every HEALTH_EVERY_S until `stop`; a slow (> HEALTH_TIMEOUT_S) or non-200 answer fails."""
    async with httpx.AsyncClient(timeout=HEALTH_TIMEOUT_S) as client:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok = (await client.get(f"{base}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            health.polls += 1
            health.failures += not ok
            health.max_latency_s = max(health.max_latency_s, time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), HEALTH_EVERY_S)


async def drive(
    base: str, jobs: list[Job], clients: int, time_limit_s: float
) -> tuple[list[Outcome], Health]:
    """`clients` concurrent clients take jobs from one queue until it is empty or the time limit passes
    (jobs never started are 'skipped'); /health is polled meanwhile."""
    queue: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + time_limit_s
    limits = httpx.Limits(
        max_connections=clients + 4, max_keepalive_connections=clients, keepalive_expiry=KEEPALIVE_S
    )

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            outcomes.append(await with_retries(client, base, queue.get_nowait(), deadline))

    stop, health = asyncio.Event(), Health()
    poller = asyncio.create_task(poll_health(base, stop, health))
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    stop.set()
    await poller
    outcomes += [Outcome(job.index, "skipped") for job in _drain_queue(queue)]
    return sorted(outcomes, key=lambda o: o.job), health


async def with_retries(client: httpx.AsyncClient, base: str, job: Job, deadline: float) -> Outcome:
    """`run_job`, again after a pause each time the server says 503 retry-later (bounded)."""
    outcome = await run_job(client, base, job)
    for attempt in range(2, RETRY_ATTEMPTS + 1):
        if outcome.kind != "retry_later" or time.monotonic() > deadline:
            break
        await asyncio.sleep(RETRY_PAUSE_S * random.uniform(0.5, 1.5))
        outcome = await run_job(client, base, job)
        outcome.attempts = attempt
    return outcome


def _drain_queue(queue: asyncio.Queue[Job]) -> list[Job]:
    left = []
    while not queue.empty():
        left.append(queue.get_nowait())
    return left


# ---- judging -------------------------------------------------------------------------------------------


@dataclass
class RunReport:
    mode: str
    wall_s: float
    outcomes: list[Outcome]
    health: Health
    drain: dict[str, Any] = field(default_factory=dict)  # pool state after the load
    faults: dict[str, Any] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)  # "job N (tenant-x) shows tenant-y's canary"
    problems: list[str] = field(default_factory=list)  # failed checks, human readable

    def counts(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)


def judge_outcomes(
    jobs: list[Job], outcomes: list[Outcome], refs: dict[int, Reference], tok: Tokenizer
) -> list[str]:
    """Fill `match` on completed outcomes; return every outcome that breaks a rule."""
    problems = []
    for outcome in outcomes:
        job = jobs[outcome.job]
        if outcome.kind == "completed":
            if job.must_reject:
                problems.append(f"job {job.index} ({job.shape}) completed but exceeds the window")
                continue
            outcome.match = compare(refs[job.index], outcome.text, tok)
            if outcome.match == "differs":
                problems.append(f"job {job.index} ({job.shape}) completed with output != its reference")
        elif outcome.kind == "rejected":
            if not job.must_reject or outcome.error_code != "context_length_exceeded":
                problems.append(f"job {job.index} ({job.shape}) refused: {outcome.error_code}")
        elif outcome.kind == "retry_later" and outcome.status != 503:
            problems.append(f"job {job.index}: {outcome.error_code} answered {outcome.status}, not 503")
        elif outcome.kind in ("error", "timeout", "skipped"):
            problems.append(
                f"job {job.index} ({job.shape}): {outcome.kind} {outcome.status} {outcome.error_code}"
            )
        elif job.must_reject:
            problems.append(f"job {job.index} ({job.shape}) exceeds the window but ended {outcome.kind}")
    return problems


def canary_leaks(jobs: list[Job], outcomes: list[Outcome], tenants: list[Tenant]) -> list[str]:
    """Any other tenant's canary in any text a client received (completed, cancelled or cut off)."""
    leaks = []
    for outcome in outcomes:
        owner = jobs[outcome.job].tenant
        for tenant in tenants:
            if tenant != owner and tenant.canary in outcome.text:
                leaks.append(f"job {outcome.job} ({owner.name}) received {tenant.name}'s canary")
    return leaks


def completed_ok_by_request(jobs: list[Job], outcomes: list[Outcome]) -> Callable[[str], bool | None]:
    """request id -> True (completed as its reference), False (completed otherwise), None (not completed)."""
    by_id = {o.request_id: o for o in outcomes if o.request_id}

    def completed_ok(request_id: str) -> bool | None:
        outcome = by_id.get(request_id)
        if outcome is None or outcome.kind != "completed":
            return None
        return outcome.match in ("exact", "near_tie")

    return completed_ok


# ---- single node ---------------------------------------------------------------------------------------


def scaled(rates: dict[str, float], scale: float) -> dict[str, float]:
    return {name: min(1.0, rate * scale) for name, rate in rates.items() if rate * scale > 0}


def serving_engine(gguf: GGUFModel, window: int, num_pages: int, faults: dict[str, float]) -> LLMEngine:
    config = EngineConfig(num_pages=num_pages, max_model_len=window, faults=faults, max_num_seqs=64)
    return LLMEngine(config, LlamaModel.from_gguf(gguf), Tokenizer.from_gguf(gguf), log=lambda _: None)


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


def drain_problems(drain: dict[str, Any]) -> list[str]:
    problems = [] if drain.get("integrity", "ok") == "ok" else [f"allocator integrity: {drain['integrity']}"]
    for key in ("referenced_pages", "quarantined_pages", "owned_uncached_pages", "live_requests"):
        if drain.get(key, 0):
            problems.append(f"after the drain {key} = {drain[key]}")
    if drain.get("pages_free") != drain.get("num_pages"):
        problems.append(f"after the drain pages_free {drain.get('pages_free')} != {drain.get('num_pages')}")
    if drain.get("metrics_pages_free") not in (None, drain.get("num_pages")):
        problems.append(f"/metrics pages_free {drain['metrics_pages_free']} != {drain.get('num_pages')}")
    return problems


async def wait_until(check: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(every_s)
    return False


def fault_summary(ledger: FaultLedger, completed_ok: Callable[[str], bool | None]) -> dict[str, Any]:
    """Per fault: how often it fired, took effect, was caught, absorbed, missed."""
    verdicts = ledger.verdicts(completed_ok)
    fired = ledger.engine.faults.fired
    table: dict[str, dict[str, int]] = {}
    for name in sorted(set(fired) | {v.fault for v in verdicts}):
        counts = Counter(v.verdict for v in verdicts if v.fault == name)
        table[name] = {"fired": fired.get(name, 0), "effects": sum(counts.values()), **counts}
    return {"by_fault": table, "effects": [asdict(v) for v in verdicts]}


def fault_problems(faults: dict[str, Any]) -> list[str]:
    return [
        f"{name}: {row.get(v, 0)} {v}"
        for name, row in faults.get("by_fault", {}).items()
        for v in ("missed", "unresolved")
        if row.get(v, 0)
    ]


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


def run_single_node(
    gguf: GGUFModel, plan: Plan, refs_engine: LLMEngine | None = None, rates: dict[str, float] = FAULT_RATES
) -> RunReport:
    """The real server over one engine with single-node faults armed at `plan.fault_scale` x `rates`."""
    tokenizer = Tokenizer.from_gguf(gguf)
    tenants = make_tenants(plan.tenants, plan.seed)
    jobs = make_jobs(tokenizer, tenants, plan.requests, plan.limits(), plan.cancel_rate, plan.seed)
    refs = compute_references(refs_engine or reference_engine(gguf, plan.window), jobs)
    engine = serving_engine(gguf, plan.window, plan.num_pages, scaled(rates, plan.fault_scale))
    ledger = FaultLedger.attach(engine)
    async_engine = AsyncEngine(engine)
    keys = {t.key: t.name for t in tenants}
    server = serve(build_app(async_engine, MODEL, keys, ADMIN_KEY))
    try:
        started = time.monotonic()
        outcomes, health = asyncio.run(drive(server.url, jobs, plan.clients, plan.time_limit_s))
        wall = time.monotonic() - started
        drain = asyncio.run(_single_node_drain(server.url, async_engine))
    finally:
        server.stop()
    report = RunReport("single", wall, outcomes, health, drain)
    report.problems = judge_outcomes(jobs, outcomes, refs, tokenizer)
    report.faults = fault_summary(ledger, completed_ok_by_request(jobs, outcomes))
    report.leaks = canary_leaks(jobs, outcomes, tenants)
    report.problems += drain_problems(drain) + fault_problems(report.faults) + report.leaks
    report.problems += (
        [f"/health failed {health.failures} of {health.polls} polls"] if health.failures else []
    )
    return report


async def _single_node_drain(base: str, engine: AsyncEngine, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait (bounded) until nothing holds a page, then read the pool on the engine thread and /metrics."""
    num_pages = engine.engine.pool.num_pages

    async def idle() -> bool:
        free = await asyncio.to_thread(metric, base, "kvfence_pages_free")
        return free == num_pages

    await wait_until(idle, timeout_s)
    drain = await asyncio.wrap_future(engine.call(lambda: engine_drain_state(engine.engine)))
    drain["metrics_pages_free"] = await asyncio.to_thread(metric, base, "kvfence_pages_free")
    return drain


# ---- disaggregated -------------------------------------------------------------------------------------


def disagg_configs(plan: Plan) -> tuple[EngineConfig, EngineConfig]:
    """Both pools hold the window (so only the window refuses), one torch thread per worker."""
    prefill = EngineConfig(
        num_pages=plan.num_pages,
        max_model_len=plan.window,
        num_threads=1,
        faults=scaled(PREFILL_FAULT_RATES, plan.fault_scale),
    )
    decode = replace(
        prefill, faults=scaled(DECODE_FAULT_RATES, plan.fault_scale), enable_prefix_caching=False
    )
    return prefill, decode


def run_disaggregated(gguf: GGUFModel, plan: Plan, refs_engine: LLMEngine | None = None) -> RunReport:
    """The same load through the Router in front of a prefill and a decode worker process."""
    tokenizer = Tokenizer.from_gguf(gguf)
    tenants = make_tenants(plan.tenants, plan.seed)
    jobs = make_jobs(tokenizer, tenants, plan.requests, plan.limits(), plan.cancel_rate, plan.seed + 1)
    refs = compute_references(refs_engine or reference_engine(gguf, plan.window), jobs)
    cluster = start_cluster(*disagg_configs(plan), {t.key: t.name for t in tenants}, ADMIN_KEY, MODEL)
    try:
        started = time.monotonic()
        outcomes, health = asyncio.run(drive(cluster.url, jobs, plan.clients, plan.time_limit_s))
        wall = time.monotonic() - started
        drain = asyncio.run(_cluster_drain(cluster))
        faults = trail_fault_summary(cluster, outcomes)
    finally:
        cluster.stop()
    report = RunReport("disagg", wall, outcomes, health, drain, faults)
    report.problems = judge_outcomes(jobs, outcomes, refs, tokenizer)
    report.leaks = canary_leaks(jobs, outcomes, tenants)
    report.problems += drain_problems(drain) + report.leaks
    report.problems += (
        [f"/health failed {health.failures} of {health.polls} polls"] if health.failures else []
    )
    return report


async def _cluster_drain(cluster: Cluster, timeout_s: float = 60.0) -> dict[str, Any]:
    """Both workers idle (bounded wait); their pools summed as the router's /metrics shows them."""

    async def idle() -> bool:
        stats = [await asyncio.to_thread(cluster.worker_stats, role) for role in ("prefill", "decode")]
        return all(s.pages_free == s.num_pages and not s.pages_by_state["quarantined"] for s in stats)

    await wait_until(idle, timeout_s, every_s=0.5)
    stats = [await asyncio.to_thread(cluster.worker_stats, role) for role in ("prefill", "decode")]
    total = stats[0] + stats[1]
    return {
        "num_pages": total.num_pages,
        "pages_free": total.pages_free,
        "quarantined_pages": total.pages_by_state["quarantined"],
        "metrics_pages_free": await asyncio.to_thread(metric, cluster.url, "kvfence_pages_free"),
        "note": "allocator.check_integrity() cannot be run remotely: workers answer stats only",
    }


def trail_fault_summary(cluster: Cluster, outcomes: list[Outcome]) -> dict[str, Any]:
    """Worker faults are counted in the workers' processes; what the harness can see is the audit trail:
    fault_injected events and integrity aborts of the requests that did not complete."""
    injected: Counter[str] = Counter()
    aborts: Counter[str] = Counter()
    for outcome in outcomes:
        if outcome.request_id is None or outcome.kind in ("completed", "rejected"):
            continue
        for event in cluster.router.audit_events(outcome.request_id):
            if event["kind"] == "fault_injected":
                injected[event["fault"]] += 1
            elif event["kind"] == "aborted" and event.get("reason") in INTEGRITY_REASONS:
                aborts[event["reason"]] += 1
    return {"fault_injected_events": dict(injected), "integrity_aborts_on_trails": dict(aborts)}


# ---- output --------------------------------------------------------------------------------------------


def print_report(report: RunReport) -> None:
    counts = report.counts()
    matches = Counter(o.match for o in report.outcomes if o.match)
    print(f"\n== {report.mode}: {len(report.outcomes)} requests in {report.wall_s:.1f}s ==")
    kinds = ("completed", "rejected", "integrity", "retry_later", "cancelled", "error", "timeout", "skipped")
    print_table(kinds, [[counts.get(k, 0) for k in kinds]])
    retries = sum(o.attempts - 1 for o in report.outcomes)
    print(
        f"completed vs reference: {dict(matches)}; canary leaks: {len(report.leaks)}; 503 retries: {retries}"
    )
    health = report.health
    print(f"/health: {health.polls} polls, {health.failures} failed, max {health.max_latency_s:.2f}s")
    by_fault = report.faults.get("by_fault")
    if by_fault:
        columns = ("fired", "effects", "caught", "absorbed", "missed", "unresolved")
        print_table(
            ("fault", *columns), [[name, *(row.get(c, 0) for c in columns)] for name, row in by_fault.items()]
        )
    elif report.faults:
        print(f"faults (from audit trails): {report.faults}")
    print(f"drain: {report.drain}")
    print("PASS" if not report.problems else "FAIL:\n  " + "\n  ".join(report.problems))


def report_json(report: RunReport) -> dict[str, Any]:
    return {
        "mode": report.mode,
        "wall_s": report.wall_s,
        "counts": dict(report.counts()),
        "matches": dict(Counter(o.match for o in report.outcomes if o.match)),
        "health": asdict(report.health),
        "drain": report.drain,
        "faults": report.faults,
        "leaks": report.leaks,
        "problems": report.problems,
        "outcomes": [asdict(o) for o in report.outcomes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["single", "disagg", "both"], default="both")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--window", type=int, default=512, help="max_model_len of every engine")
    parser.add_argument("--num-pages", type=int, default=128, help="pages per pool (16 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a job asks for")
    parser.add_argument("--cancel-rate", type=float, default=0.2)
    parser.add_argument("--fault-scale", type=float, default=1.0, help="multiplies every fault rate; 0: off")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds of load per mode, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (see below)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan = Plan(
        args.clients,
        args.requests,
        args.tenants,
        args.window,
        args.num_pages,
        args.max_tokens,
        args.cancel_rate,
        args.fault_scale,
        args.time_limit,
        args.seed,
    )
    gguf = load_weights()
    refs_engine = reference_engine(gguf, plan.window)
    reports = []
    if args.mode in ("single", "both"):
        reports.append(run_single_node(gguf, plan, refs_engine))
        print_report(reports[-1])
    if args.mode in ("disagg", "both"):
        reports.append(run_disaggregated(gguf, plan, refs_engine))
        print_report(reports[-1])
    write_json("stress", {"plan": asdict(plan), "runs": [report_json(r) for r in reports]})
    raise SystemExit(1 if any(r.problems for r in reports) else 0)


if __name__ == "__main__":
    main()
