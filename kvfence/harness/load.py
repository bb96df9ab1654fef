"""The load generator: tenants with canaries, jobs of exact prompt lengths, and clients that run them.

Every prompt is token ids of exact length: short ones, ones on page boundaries, ones exactly at the
context window (prompt + max_tokens == window: must complete) and just beyond it (must be refused with
400 before anything is reserved). Each tenant's prompts start with its own canary. Every request is
greedy with ignore_eos and a fixed max_tokens, so its output is fully determined by its prompt.

Contracts: `run_job` never raises for anything the server or the network does: every way a request can
end is an `Outcome` (completed, rejected, integrity, retry_later, cancelled, error, timeout, skipped), and
each is bounded by its timeout. `drive` runs a job list with N concurrent clients, bounded by a time limit
(jobs never started are 'skipped'), retrying 503 retry-later answers after a pause, and polls /health
meanwhile. Streams are read with the project's one SSE parser (kvfence.harness.sse).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvfence.harness.sse import MalformedEvent, aiter_events
from kvfence.model.tokenizer import Tokenizer
from kvfence.units import cdiv

MODEL = "smollm2-stress"  # the model name every job asks for (the harness serves under it)
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
RETRY_LATER = frozenset({"server_busy", "prefill_unavailable", "decode_unavailable"})  # 503: never started
RETRY_ATTEMPTS = 30
RETRY_PAUSE_S = 0.5
_WORD_TEXT = (
    "river mountain lantern copper violet harbor meadow engine quartz willow falcon ember canyon marble "
    "orchard thunder glacier saffron compass beacon velvet cobalt prairie summit harvest crystal maple "
    "signal anchor cedar timber lagoon"
)
WORDS = tuple(_WORD_TEXT.split())  # filler words of generated prompts

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
        return "retry_later"  # judged by the run rules: it must come as a 503
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
        async with contextlib.aclosing(aiter_events(response.aiter_lines())) as events:
            outcome.kind = await _read_events(events, job, outcome, on_chunk)


async def _read_events(
    events: AsyncIterator[dict[str, Any]], job: Job, outcome: Outcome, on_chunk: Callable[[], None] | None
) -> str:
    """Consume SSE events; the kind the stream ended with. Hang up after `job.cancel_after` content chunks
    (leaving the `stream` block closes the connection mid-stream: the cancellation the server must handle)."""
    chunks = 0
    async for event in events:
        if "error" in event:
            _set_error(outcome, 500, event["error"])  # an error event after a 200: the request failed
            return outcome.kind
        choice = event["choices"][0]
        outcome.text += choice["text"]
        chunks += 1
        if on_chunk is not None:
            on_chunk()
        if choice.get("finish_reason"):
            return "completed"
        if job.cancel_after is not None and chunks >= job.cancel_after:
            return "cancelled"
    return "error"  # the stream ended with neither a finish nor an error event


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
    except (httpx.HTTPError, json.JSONDecodeError, MalformedEvent, KeyError) as exc:
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
