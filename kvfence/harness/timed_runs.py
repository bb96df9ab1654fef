"""Timed workload runs against kvfence: offline (an engine stepped in this process) and over HTTP (streams
to a running server), each giving the timings of `timings.py`.

Contracts: `run_kvfence` keeps at most `concurrency` requests in flight, greedy with ignore_eos, and asserts
that every request yields exactly `max_tokens` tokens; `run_streams` streams prompts of token ids to a
server (`streams.drive`: a broken or short answer raises), at most `concurrency` at once; `warm_up` runs
a short mixed prefill/decode load so one-off allocations are not measured.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections import deque
from collections.abc import Sequence

from kvfence.engine.engine import LLMEngine
from kvfence.harness.contention import ForeignCpu
from kvfence.harness.offline_engine import make_prompts
from kvfence.harness.streams import GREEDY, Sampling, drive
from kvfence.harness.timings import RequestTiming, RunResult, request_timing
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path
from kvfence.sampling import SamplingParams


def run_streams(
    url: str,
    prompts: Sequence[list[int]],
    max_tokens: int,
    concurrency: int,
    model: str | None = None,
    sampling: Sampling = GREEDY,
) -> tuple[list[str], list[RequestTiming], float]:
    """`prompts` streamed to a running server (kvfence.harness.streams), at most `concurrency` at once:
    the request ids, each request's timing and the wall time. `model` defaults to the packaged SmolLM2's."""
    done, wall = asyncio.run(
        drive(url, model or default_model_path().stem, list(prompts), max_tokens, concurrency, sampling)
    )
    timings = [RequestTiming(t.ttft, t.tpot, t.latency, t.tokens) for t in done]
    return [t.request_id for t in done], timings, wall


def run_kvfence(
    engine: LLMEngine, prompts: Sequence[list[int]], max_tokens: int, concurrency: int, label: str = "kvfence"
) -> RunResult:
    """Keep at most `concurrency` requests in flight (a new one is added as soon as one finishes) and step
    until all are done. Greedy with ignore_eos, so every request yields exactly `max_tokens` tokens."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    pending, in_flight, finished = deque(prompts), [], []
    gc.collect()
    fence_before, steps, step_s = engine.fence.stats.seconds, 0, 0.0
    foreign = ForeignCpu()
    started = time.monotonic()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            in_flight.append(engine.add_request(pending.popleft(), params))
        step_started = time.monotonic()
        engine.step()
        step_s += time.monotonic() - step_started
        steps += 1
        finished += [r for r in in_flight if r.is_finished]
        in_flight = [r for r in in_flight if not r.is_finished]
    wall = time.monotonic() - started
    timings = [request_timing(r) for r in finished]
    assert all(t.num_output == max_tokens for t in timings), "every request must produce max_tokens"
    return RunResult(
        label,
        concurrency,
        len(finished),
        wall,
        sum(t.num_output for t in timings),
        timings,
        step_s=step_s,
        fence_s=engine.fence.stats.seconds - fence_before,
        steps=steps,
        foreign_cpu=foreign.share(),
    )


def warm_up(engine: LLMEngine, tokenizer: Tokenizer) -> None:
    """A short mixed prefill/decode run so one-off allocations and kernel choices are not measured."""
    run_kvfence(engine, make_prompts(tokenizer, 4, 48, salt=-1), max_tokens=8, concurrency=4)
