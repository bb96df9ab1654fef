"""N prefill x M decode workers behind one router, on the tiny model: fast, and every greedy answer can be
checked against the same model serving alone.

- Routing (no sockets): the worker with the most headroom, the first listed on a tie; a pool is compared
  alone, never summed over workers; a worker that cannot hold the request is skipped, one that is lost
  too, and a role with none left answers 503 at once.
- 2 x 2 on threads: concurrent requests and one cancellation; every completed answer equals its solo
  greedy tokens, both decode workers were used, and every pool is free after the drain.
- 1 x 2 as processes: kill -9 of one decode worker mid-load. Its requests end with `decode_lost`, the
  other's complete with their solo tokens, new requests go to the survivor, the surviving pools drain,
  and the restarted worker rejoins and serves again.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from collections.abc import Callable

from conftest import make_engine, tiny_model

from kvfence.config import EngineConfig
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.router import Router
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.workers import InThread, Spawned, SpawnedWorker
from kvfence.model.transformer import Transformer
from kvfence.request import Status
from kvfence.sampling import SamplingParams

WINDOW = 48
TINY_WORKER = EngineConfig(num_pages=64, page_size=4, max_num_batched_tokens=64, max_model_len=WINDOW)
WAIT_S = 60.0  # the bound on every wait here
Answer = tuple[Status, str | None, list[int]]  # how a request ended, and its tokens


def tiny_worker_engine(config: EngineConfig) -> HandoffEngine:
    """A spawned worker's engine: the tiny model of conftest (the same seed, so the same weights)."""
    return HandoffEngine(config, tiny_model(), log=lambda _: None)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(2, 30))] for _ in range(count)]


def solo(model: Transformer, prompt: list[int], max_tokens: int) -> list[int]:
    engine = make_engine(model, max_model_len=WINDOW)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].output_token_ids


async def ask(router: Router, prompt: list[int], max_tokens: int, request_id: str) -> Answer:
    """One request through the router, to its end: (status, finish reason, tokens)."""
    tokens: list[int] = []
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async for output in router.generate(prompt, params, "tenant", request_id):
        tokens += output.new_token_ids
        if output.finished:
            return output.status, output.finish_reason, tokens
    raise AssertionError(f"{request_id} ended without a finished output")


async def wait_for(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def wait_drained(running: Cluster, names: list[str]) -> None:
    """Until every named worker's pool is all free, nothing quarantined (bounded)."""
    deadline = time.monotonic() + WAIT_S
    for name in names:
        while True:
            stats = await asyncio.to_thread(running.worker_stats, name)
            if stats.pages_free == stats.num_pages and not stats.pages_by_state["quarantined"]:
                break
            assert time.monotonic() < deadline, f"{name} did not drain: {stats}"
            await asyncio.sleep(0.1)


# ---- 2 x 2 on threads ---------------------------------------------------------------------------------


def test_two_by_two_answers_like_solo_and_drains(tiny: Transformer) -> None:
    engines = [make_engine(tiny, HandoffEngine, max_model_len=WINDOW) for _ in range(4)]
    workers = [InThread(engine) for engine in engines]
    with cluster(prefill=workers[:2], decode=workers[2:], http=False) as running:
        asyncio.run(_two_by_two(running, tiny))


async def _two_by_two(running: Cluster, tiny: Transformer) -> None:
    router, jobs = running.router, prompts(8, seed=1)
    cancelled = router.generate(jobs[0], SamplingParams(max_tokens=16, ignore_eos=True), "tenant", "cancel")
    first = await anext(cancelled)
    assert not first.finished
    answers = await asyncio.gather(*(ask(router, p, 6, f"r{i}") for i, p in enumerate(jobs)))
    await cancelled.aclose()  # the client hangs up mid-stream: decode aborts it and frees its pages
    for prompt, (status, reason, tokens) in zip(jobs, answers, strict=True):
        assert (status, reason, tokens) == (Status.FINISHED, "length", solo(tiny, prompt, 6))
    assert all(router.placement.routed[name] >= 2 for name in running.workers), router.placement.routed
    await wait_drained(running, list(running.workers))
    assert router.down == set() and sorted(router.info()["pools"]) == sorted(running.workers)


# ---- kill -9 of one decode worker of two ----------------------------------------------------------------


def test_a_killed_decode_worker_takes_only_its_requests_and_rejoins(tiny: Transformer) -> None:
    worker = Spawned(TINY_WORKER, build=tiny_worker_engine)
    with cluster(prefill=worker, decode=[worker, worker], http=False) as running:
        asyncio.run(_kill_one_decode(running, tiny))


async def _kill_one_decode(running: Cluster, tiny: Transformer) -> None:
    router, victim = running.router, running.workers["decode-1"]
    assert isinstance(victim, SpawnedWorker) and victim.pid is not None
    jobs = prompts(6, seed=2)
    os.kill(victim.pid, signal.SIGSTOP)  # frozen: what it was given stays in flight until it dies
    tasks = [asyncio.create_task(ask(router, p, 6, f"k{i}")) for i, p in enumerate(jobs)]
    await asyncio.sleep(0)
    doomed = {rid for rid, route in router.placement.routes.items() if route.decode == victim.address}
    assert 0 < len(doomed) < len(jobs), "the load was not spread over both decode workers"
    survivors = [t for i, t in enumerate(tasks) if f"k{i}" not in doomed]
    await asyncio.wait_for(asyncio.gather(*survivors), WAIT_S)  # the other worker serves meanwhile
    os.kill(victim.pid, signal.SIGKILL)
    answers = await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    for i, (prompt, answer) in enumerate(zip(jobs, answers, strict=True)):
        lost = (Status.ABORTED, "decode_lost", [])
        assert answer == (lost if f"k{i}" in doomed else (Status.FINISHED, "length", solo(tiny, prompt, 6)))
    await wait_for(lambda: "decode-1" in router.down, "the router to see decode-1 lost")
    assert (await ask(router, jobs[0], 6, "while-down"))[2] == solo(tiny, jobs[0], 6)
    await wait_drained(running, ["prefill", "decode-0"])  # the surviving side holds nothing of it
    await asyncio.to_thread(victim.restart)
    await wait_for(lambda: not router.down, "decode-1 to say hello again")
    before = router.placement.routed["decode-1"]
    again = await asyncio.gather(*(ask(router, p, 6, f"a{i}") for i, p in enumerate(jobs[:4])))
    assert [a[2] for a in again] == [solo(tiny, p, 6) for p in jobs[:4]]
    assert router.placement.routed["decode-1"] > before, "the restarted worker was not used"
