"""kill -9 of a worker process mid-load through the Router, then its restart on the SAME address.

Decode crash: every request decoding there ends at once with a clear error (`decode_lost`), a request sent
while decode is down is answered 503 `decode_unavailable` at once by the router (with Retry-After), and
requests after the restart complete. Prefill crash: requests whose KV was still to come end
with `prefill_lost` and their decode pages go aborted -> quarantined -> drained(peer_down) -> released with
no reuse in between; requests already decoding complete with their reference output; while prefill is down
decode refuses new work with 503 `prefill_unavailable`; after the restart requests complete again.
tests/integration/test_disagg_e2e.py covers the prefill crash without a restart; this file adds recovery
and decode. A decode crash while the router waits for a reservation ends that request with `decode_lost`
too. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import httpx
import pytest

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.load import KEEPALIVE_S, MODEL, Job, Outcome, Tenant, run_job, tenant_prompt
from kvfence.harness.references import EXACT, compare, compute_references, reference_engine
from kvfence.harness.workers import Spawned, SpawnedWorker
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.units import cdiv

pytestmark = pytest.mark.real_model

WINDOW = 256
PREFILL = EngineConfig(num_pages=64, max_model_len=WINDOW, num_threads=1, activation_dtype=EXACT)  # as refs
DECODE = replace(PREFILL, enable_prefix_caching=False)
TENANT = Tenant("tenant-a", "key-a", "ZORBLAX-4471")
ADMIN = "crash-admin"
ROUTER_TIMEOUT_S = 60.0  # well above a worker restart (about 15-35 s here)
WAIT_S = 120.0  # the bound on every wait in this file
LOST = {"decode_lost", "prefill_lost"}


T = TypeVar("T")
Pairs = list[tuple[Job, Outcome]]  # jobs with how they ended


@pytest.fixture(scope="module", name="cluster")
def running_cluster() -> Iterator[Cluster]:
    with cluster(
        prefill=Spawned(PREFILL),
        decode=Spawned(DECODE),
        api_keys={TENANT.key: TENANT.name},
        admin_key=ADMIN,
        model_name=MODEL,
        router_timeout_s=ROUTER_TIMEOUT_S,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def refs_engine(smollm2: GGUFModel) -> LLMEngine:
    return reference_engine(smollm2, WINDOW)


def worker(cluster: Cluster, role: str) -> SpawnedWorker:
    """The role's worker process (these tests kill, freeze and restart it)."""
    spawned = cluster.workers[role]
    assert isinstance(spawned, SpawnedWorker)
    return spawned


class Jobs:
    """Numbered jobs of TENANT with exact prompt lengths."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.rng, self.count = tokenizer, random.Random(0), 0

    def __call__(self, prompt_len: int, max_tokens: int, stream: bool) -> Job:
        self.count += 1
        prompt = tenant_prompt(self.tokenizer, TENANT, prompt_len, self.rng)
        return Job(self.count, TENANT, "crash", prompt, max_tokens, stream, None, WINDOW)


@pytest.fixture
def jobs(smollm2: GGUFModel) -> Jobs:
    return Jobs(Tokenizer.from_gguf(smollm2))


def new_client() -> httpx.AsyncClient:
    """Idle connections expire before the server's keep-alive does (no ReadError from that race)."""
    return httpx.AsyncClient(timeout=WAIT_S, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(asyncio.wait_for(coro, WAIT_S * 2))


async def decoding(client: httpx.AsyncClient, url: str, job_list: list[Job]) -> list[asyncio.Task[Outcome]]:
    """Start streaming jobs; return once each has streamed a first token (it is decoding, its KV moved)."""
    started = [asyncio.Event() for _ in job_list]
    tasks = [
        asyncio.create_task(run_job(client, url, job, on_chunk=event.set, timeout_s=WAIT_S))
        for job, event in zip(job_list, started, strict=True)
    ]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), WAIT_S)
    return tasks


async def recovered(client: httpx.AsyncClient, cluster: Cluster, jobs: Jobs) -> tuple[Job, Outcome]:
    """Send a short request every half second until one completes (bounded); returns that outcome."""
    deadline = time.monotonic() + WAIT_S
    while True:
        job = jobs(24, 6, stream=False)
        outcome = await run_job(client, cluster.url, job, timeout_s=WAIT_S)
        if outcome.kind == "completed" or time.monotonic() > deadline:
            return job, outcome
        await asyncio.sleep(0.5)


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def pools_clean(cluster: Cluster) -> bool:
    stats = [cluster.worker_stats(role) for role in ("prefill", "decode")]
    return all(s.pages_free == s.num_pages and s.pages_by_state["quarantined"] == 0 for s in stats)


def assert_matches(refs_engine: LLMEngine, pairs: Pairs) -> None:
    """Each (job, outcome) completed with its offline greedy reference."""
    refs = compute_references(refs_engine, [job for job, _ in pairs])
    assert refs_engine.tokenizer is not None
    for job, outcome in pairs:
        assert outcome.kind == "completed", (outcome.kind, outcome.status, outcome.error_code)
        assert compare(refs[job.index], outcome.text, refs_engine.tokenizer) != "differs"


def test_decode_crash_fails_its_requests_and_recovers(
    cluster: Cluster, jobs: Jobs, refs_engine: LLMEngine
) -> None:
    async def scenario() -> tuple[list[Outcome], Outcome, Any, Pairs]:
        async with new_client() as client:
            tasks = await decoding(client, cluster.url, [jobs(40, 64, stream=True) for _ in range(4)])
            cluster.workers["decode"].kill()
            lost = await asyncio.gather(*tasks)
            refused = await run_job(client, cluster.url, jobs(40, 8, stream=False), timeout_s=WAIT_S)
            health = (await client.get(f"{cluster.url}/health")).json()
            await asyncio.to_thread(cluster.workers["decode"].restart)
            return lost, refused, health, [await recovered(client, cluster, jobs)]

    lost, refused, health, completed = run(scenario())
    assert health == {"status": "ok", "workers": {"prefill": "up", "decode": "down"}}
    for outcome in lost:
        # decode_lost: ended by the link going down, not by the router's 60 s timeout (router_timeout)
        assert (outcome.kind, outcome.error_code) == ("error", "decode_lost")
    # refused at once (503 decode_unavailable), not queued for the dead worker until a timeout
    assert (refused.kind, refused.status, refused.error_code) == ("retry_later", 503, "decode_unavailable")
    assert refused.retry_after == "1"
    assert_matches(refs_engine, completed)
    wait_for(lambda: pools_clean(cluster), "both pools to drain")


def decode_trail(cluster: Cluster, request_id: str) -> list[dict[str, Any]]:
    return [e for e in cluster.router.audit_events(request_id) if e["where"] == "decode"]


def assert_fenced_before_reuse(cluster: Cluster, victim: str, others: list[str]) -> None:
    """The victim's decode trail runs aborted -> quarantined -> drained(peer_down) -> released, and no
    other request was handed one of its pages between quarantine and release."""
    trail = decode_trail(cluster, victim)
    kinds = [e["kind"] for e in trail]
    order = ["aborted", "quarantined", "drained", "released"]
    assert [k for k in kinds if k in order] == order, kinds
    by_kind = {e["kind"]: e for e in trail}
    assert by_kind["aborted"]["reason"] == "prefill_lost" and by_kind["drained"]["how"] == "peer_down"
    pages = set(by_kind["quarantined"]["pages"])
    start, end = by_kind["quarantined"]["seq"], by_kind["released"]["seq"]
    for other in others:
        for event in decode_trail(cluster, other):
            if event["kind"] == "pages_allocated" and start < event["seq"] < end:
                assert not pages & set(event["pages"]), f"{other} got a quarantined page of {victim}"


def test_prefill_crash_fences_its_transfers_and_recovers(
    cluster: Cluster, jobs: Jobs, refs_engine: LLMEngine
) -> None:
    prefill = worker(cluster, "prefill")
    victims = [jobs(150, 8, stream=False) for _ in range(3)]

    async def reserved_on_decode(client: httpx.AsyncClient) -> list[asyncio.Task[Outcome]]:
        """With prefill frozen, start the victims and wait until decode reserved their pages."""
        free = cluster.worker_stats("decode").pages_free
        os.kill(prefill.process.pid, signal.SIGSTOP)
        tasks = [asyncio.create_task(run_job(client, cluster.url, j, timeout_s=WAIT_S)) for j in victims]
        per_victim = cdiv(149, 16)
        await asyncio.to_thread(
            wait_for,
            lambda: cluster.worker_stats("decode").pages_free <= free - len(victims) * per_victim,
            "decode to reserve the victims' pages",
        )
        return tasks

    async def scenario() -> tuple[list[Outcome], Pairs, Outcome, Pairs]:
        async with new_client() as client:
            survivor_jobs = [jobs(40, 48, stream=True) for _ in range(2)]
            survivors = await decoding(client, cluster.url, survivor_jobs)
            victim_tasks = await reserved_on_decode(client)
            prefill.kill()  # SIGKILL ends the stopped process: its transfers die mid-flight
            lost = await asyncio.gather(*victim_tasks)
            refused = await run_job(client, cluster.url, jobs(40, 8, stream=False), timeout_s=WAIT_S)
            await asyncio.to_thread(prefill.restart)
            done = list(zip(survivor_jobs, await asyncio.gather(*survivors), strict=True))
            return lost, done, refused, [await recovered(client, cluster, jobs)]

    lost, survived, refused, after = run(scenario())
    for outcome in lost:
        assert (outcome.kind, outcome.error_code) == ("error", "prefill_lost")
    assert (refused.kind, refused.status, refused.error_code) == ("retry_later", 503, "prefill_unavailable")
    assert refused.retry_after == "1"
    assert_matches(refs_engine, survived + after)
    others = [o.request_id for _, o in survived + after if o.request_id]
    for outcome in lost:
        assert_fenced_before_reuse(cluster, outcome.request_id, others)
    wait_for(lambda: pools_clean(cluster), "both pools to drain")


def test_decode_crash_during_reservation_is_a_clear_error(cluster: Cluster, jobs: Jobs) -> None:
    """The router is waiting for decode's answer to `reserve` when decode dies: the request ends with
    `decode_lost` like the others, not with an internal error; the `reserve` and `abort` still queued for
    the dead worker reach its successor, which must end up holding nothing."""
    decode = worker(cluster, "decode")

    async def scenario() -> Outcome:
        async with new_client() as client:
            os.kill(decode.process.pid, signal.SIGSTOP)
            task = asyncio.create_task(run_job(client, cluster.url, jobs(40, 8, False), timeout_s=WAIT_S))
            # Placed (a route is taken just before `reserve` is queued): the router waits for the frozen
            # worker. Not a pause: on a busy machine the request may reach the router late.
            deadline = time.monotonic() + WAIT_S
            while not cluster.router.placement.routes:
                assert time.monotonic() < deadline, "the request never reached the router"
                await asyncio.sleep(0.05)
            decode.kill()
            return await task

    try:
        outcome = run(scenario())
    finally:
        decode.restart()
    assert (outcome.kind, outcome.status, outcome.error_code) == ("error", 500, "decode_lost")
    wait_for(lambda: pools_clean(cluster), "both pools to drain")


def test_a_worker_restarted_with_a_smaller_pool_shrinks_what_the_router_admits(
    cluster: Cluster, jobs: Jobs
) -> None:
    """The router learns a reconnected worker's pool again (its hello) before sending it anything, so a
    request only the old pool could hold is refused with 400, before any page, instead of being sent to a
    decode worker that cannot hold it. The pins at /v1/audit/info name the new process."""
    decode = worker(cluster, "decode")
    original = decode.config
    try:
        decode.config = replace(original, num_pages=8, max_model_len=128)
        decode.restart()
        wait_for(lambda: cluster.router.max_model_len == 128, "the router to adopt the smaller decode pool")
        assert cluster.router.info()["pools"]["decode"]["pid"] == decode.process.pid

        async def too_long_now() -> Outcome:
            async with new_client() as client:
                return await run_job(client, cluster.url, jobs(40, 100, stream=False), timeout_s=WAIT_S)

        outcome = run(too_long_now())
        assert (outcome.kind, outcome.status, outcome.error_code) == (
            "rejected",
            400,
            "context_length_exceeded",
        )
        kinds = [(e["where"], e["kind"]) for e in cluster.router.audit_events(outcome.request_id)]
        assert kinds == [("router", "rejected")], "something was reserved or run for a refused request"
    finally:
        decode.config = original
        decode.restart()
        wait_for(lambda: cluster.router.max_model_len == WINDOW, "the router to adopt the original pool")
