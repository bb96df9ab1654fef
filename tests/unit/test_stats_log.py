"""The serving console's logs (kvfence/api/stats_log.py): vLLM's stats line from known counters on a fake
clock, and the request log of a served request."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import httpx
import pytest
from conftest import make_engine, real_engine, serving

from kvfence.api.server import build_app
from kvfence.api.stats_log import RequestLog, StatsLogger, stats_line
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.stats import EngineStats
from kvfence.model.gguf import GGUFModel
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

POOL = EngineStats(
    num_pages=200,
    pages_free=150,
    pages_by_state={},
    prefix_hits=0,
    integrity_aborts={},
    refused_writes=0,
    validation_checks=0,
    validation_seconds=0.0,
    num_running=3,
    num_waiting=2,
    prefix_query_tokens=64,
    prefix_hit_tokens=16,
)


def with_tokens(stats: EngineStats, prompt: int, generated: int) -> EngineStats:
    return dataclasses.replace(stats, prompt_tokens_computed=prompt, generation_tokens=generated)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_line_is_vllms_format_from_the_counters() -> None:
    assert stats_line(12.34, 5.0, POOL) == (
        "Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 3 reqs, "
        "Waiting: 2 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%"
    )


def test_throughput_is_per_interval_and_idle_repeats_drop_to_debug(caplog: pytest.LogCaptureFixture) -> None:
    clock, counters = Clock(), [with_tokens(POOL, 0, 0)]
    logger = StatsLogger(lambda: {"single": counters[-1]}, clock)
    caplog.set_level(logging.DEBUG, logger="kvfence.stats")
    ticks = [(10.0, 500, 100), (5.0, 500, 150), (10.0, 500, 150), (10.0, 500, 150)]
    for seconds, prompt, generated in ticks:
        clock.now += seconds
        counters.append(with_tokens(POOL, prompt, generated))
        logger.tick()
    lines = [(r.levelname, r.getMessage().split(", Running")[0]) for r in caplog.records]
    assert lines == [
        ("INFO", "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s"),
        ("INFO", "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 10.0 tokens/s"),
        ("INFO", "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"),
        ("DEBUG", "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s"),
    ]


def test_each_pool_has_its_line_and_the_router_none() -> None:
    clock = Clock()
    router = EngineStats.transport_only({"bad_frame": 1})
    read = {"prefill": with_tokens(POOL, 300, 0), "decode": with_tokens(POOL, 0, 40), "router": router}
    logger = StatsLogger(lambda: read, clock)
    clock.now += 10
    prefill, decode = logger.tick()
    assert prefill.startswith("prefill: Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 0.0")
    assert decode.startswith("decode: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 4.0")


@pytest.fixture
def engine(smollm2: GGUFModel) -> AsyncEngine:
    """One per test: the app that serves it starts its thread, and stops it for good on exit."""
    return AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=512))


def served(engine: AsyncEngine, with_prompts: bool) -> Iterator[str]:
    log = RequestLog(engine.tokenizer, with_prompts)
    return serving(build_app(engine, "m", {"secret-key-a": "tenant-a"}, None, request_log=log))


@pytest.mark.real_model
@pytest.mark.parametrize("with_prompts", [False, True])
def test_a_served_request_is_logged_at_arrival_and_end(
    engine: AsyncEngine, with_prompts: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvfence.requests")
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "cache_salt": "s3cret"}
    with served(engine, with_prompts) as url:
        answer = httpx.post(
            f"{url}/v1/completions", json=body, headers={"authorization": "Bearer secret-key-a"}, timeout=60
        )
    assert answer.status_code == 200, answer.text
    request_id, prompt = answer.json()["id"], answer.json()["usage"]["prompt_tokens"]
    arrived, finished = (r.getMessage() for r in caplog.records if r.name == "kvfence.requests")
    assert arrived.startswith(f"Received request {request_id}: tenant: tenant-a, prompt tokens: {prompt}, ")
    assert "max_tokens=3" in arrived and "cache_salt='<set>'" in arrived
    assert finished == f"Finished request {request_id}: length after 3 tokens (prompt tokens: {prompt})"
    logged = arrived + finished
    assert "secret-key-a" not in logged and "s3cret" not in logged
    assert ("The capital of France is" in logged) == with_prompts


def test_the_engine_counts_prompt_tokens_it_computed_and_tokens_it_sampled(tiny: Transformer) -> None:
    engine = make_engine(tiny)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompt = list(range(1, 14))  # three full pages of 4 and one token
    engine.generate([prompt, list(range(30, 36))], params)
    stats = EngineStats.read(engine)
    assert (stats.prompt_tokens_computed, stats.generation_tokens) == (13 + 6, 10)
    engine.generate([prompt], params)  # its three full pages come from the prefix cache
    stats = EngineStats.read(engine)
    assert (stats.prompt_tokens_computed, stats.generation_tokens) == (13 + 6 + 1, 15)


def test_prompt_logging_without_the_request_log_is_refused_at_start() -> None:
    from kvfence.cli import build_parser
    from kvfence.cli_checks import check_http
    from kvfence.startup import StartupError

    args = build_parser().parse_args(["serve", "--log-request-prompts"])  # refused before any bind
    with pytest.raises(StartupError, match=r"--log-request-prompts: .* give both"):
        check_http(args)
