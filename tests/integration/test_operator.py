"""What an operator sees. vLLM's core series on /metrics, checked against the engine at a moment the test
freezes: requests running and waiting, KV cache usage (held pages over all pages), the end-to-end latency
histogram of finished requests, and the `model_name` label on each. And `kvfence generate` streaming: each
step's text is written and flushed as the step gives it, not printed once at the end.

Both build their engines on one SmolLM2 model per module: building it costs seconds, and an engine keeps
its state (pool, scheduler) outside the model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import serving
from prometheus_client.parser import text_string_to_metric_families

from kvfence import cli
from kvfence.api.server import build_app
from kvfence.config import EngineConfig
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer

pytestmark = pytest.mark.real_model

MODEL = "smollm2-metrics"
LABELS = {"role": "single", "model_name": MODEL}
REQUESTS, MAX_NUM_SEQS, MAX_TOKENS = 4, 2, 8
# Its greedy continuation counts on (no early EOS within MAX_TOKENS); over two pages long, so finished
# requests leave cached prefix pages behind.
COUNTING = ", ".join(str(i) for i in range(1, 15)) + ","


@pytest.fixture(scope="module")
def new_engine(smollm2: GGUFModel) -> Callable[..., LLMEngine]:
    """Engines of this module's one model: `new_engine(**EngineConfig overrides)`."""
    model, tokenizer = Transformer.from_gguf(smollm2), Tokenizer.from_gguf(smollm2)

    def build(**overrides: Any) -> LLMEngine:
        config = EngineConfig(**{"num_pages": 64, "max_model_len": 256, **overrides})
        return LLMEngine(config, model, tokenizer, log=lambda _: None)

    return build


@pytest.fixture
def served(new_engine: Callable[..., LLMEngine]) -> Iterator[tuple[AsyncEngine, str]]:
    """A fresh server (so every request it counted is this test's) that runs two requests at a time."""
    engine = AsyncEngine(new_engine(max_num_seqs=MAX_NUM_SEQS))
    with serving(build_app(engine, MODEL, None, None)) as url:
        yield engine, url


def sample(text: str, name: str, labels: dict[str, str] | None = None, absent: float | None = None) -> float:
    """The one sample `name` of a scrape whose labels include `labels` (`absent` if there is none and that
    is allowed)."""
    wanted = (labels or {}).items()
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and wanted <= s.labels.items()
    ]
    if not values and absent is not None:
        return absent
    (value,) = values
    return float(value)


def stream(url: str, started: threading.Semaphore) -> None:
    """One streamed completion; `started` is released at its first token (it is running by then)."""
    body = {"model": MODEL, "prompt": COUNTING, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        lines = (line for line in response.iter_lines() if line.startswith("data: {"))
        next(lines)
        started.release()
        for _ in lines:
            pass


def frozen(engine: AsyncEngine, read: Callable[[], Any], scrape: Callable[[], str]) -> tuple[Any, str]:
    """`read()` and a /metrics `scrape()` at one moment: the engine thread is held between two steps, the
    state read while it waits, and released only once the scrape's stats read is queued behind the hold
    (commands run in order, with no step between them)."""
    holding, release, queued = threading.Event(), threading.Event(), threading.Event()
    engine.call(lambda: (holding.set(), release.wait(30)))
    assert holding.wait(30)
    state = read()
    real_call = engine.call
    engine.call = lambda fn: (real_call(fn), queued.set())[0]  # type: ignore[method-assign]
    try:
        with ThreadPoolExecutor(1) as pool:
            text = pool.submit(scrape)
            assert queued.wait(30)
            release.set()
            return state, text.result(timeout=30)
    finally:
        release.set()
        del engine.call  # the class's method again


def settled(url: str, timeout_s: float = 30.0) -> str:
    """A scrape once every request is counted: a stream's count lands when the server closes it, which may
    be just after the client read its end."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics").text
        if sample(text, "kvfence_requests_total", {"status": "finished"}, absent=0) == REQUESTS:
            return text
        assert time.monotonic() < deadline, "the finished requests were never all counted"
        time.sleep(0.05)


def test_vllm_series_match_the_engine(served: tuple[AsyncEngine, str]) -> None:
    engine, url = served
    core = engine.engine
    started = threading.Semaphore(0)
    clients = [threading.Thread(target=stream, args=(url, started)) for _ in range(REQUESTS)]
    for client in clients:
        client.start()
    for _ in range(MAX_NUM_SEQS):  # the first two stream: they run, the other two wait for a slot
        assert started.acquire(timeout=60)

    def state() -> tuple[int, int, int]:
        held = core.pool.num_pages - core.allocator.num_free_pages
        return len(core.scheduler.running), len(core.scheduler.waiting), held

    (running, waiting, held), text = frozen(engine, state, lambda: httpx.get(f"{url}/metrics").text)
    assert (running, waiting) == (MAX_NUM_SEQS, REQUESTS - MAX_NUM_SEQS)
    assert sample(text, "kvfence_num_requests_running", LABELS) == running
    assert sample(text, "kvfence_num_requests_waiting", LABELS) == waiting
    assert held > 0
    assert sample(text, "kvfence_kv_cache_usage_ratio", LABELS) == held / core.pool.num_pages
    assert sample(text, "kvfence_pages_used", {"role": "single"}) == held

    for client in clients:
        client.join(timeout=120)
    text = settled(url)
    finished = sample(text, "kvfence_requests_total", {"status": "finished"})
    assert finished == REQUESTS
    by_model = {"model_name": MODEL}
    assert sample(text, "kvfence_e2e_request_latency_seconds_count", by_model) == finished
    assert sample(text, "kvfence_e2e_request_latency_seconds_sum", by_model) > 0
    assert sample(text, "kvfence_num_requests_running", LABELS) == 0
    assert sample(text, "kvfence_num_requests_waiting", LABELS) == 0
    # The finished requests' pages stay cached: free to allocate, not in state free.
    assert sample(text, "kvfence_kv_cache_usage_ratio", LABELS) == 0
    free = sample(text, "kvfence_pages", {"role": "single", "state": "free"})
    assert sample(text, "kvfence_pages_free", {"role": "single"}) == core.pool.num_pages > free


class StepStamped:
    """A stdout that notes, for every write and flush, how many steps the engine had run."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.writes: list[tuple[int, str]] = []
        self.flushes: list[int] = []

    def write(self, text: str) -> int:
        self.writes.append((self.engine.num_steps, text))
        return len(text)

    def flush(self) -> None:
        self.flushes.append(self.engine.num_steps)


def test_generate_prints_each_piece_as_it_comes(
    new_engine: Callable[..., LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`kvfence generate` in process, its engine this module's (loading the model again costs seconds)."""
    engine = new_engine()
    out = StepStamped(engine)
    monkeypatch.setattr(cli, "_load_engine", lambda config, events=None: engine)
    monkeypatch.setattr("sys.stdout", out)
    assert cli.main(["generate", "--raw", COUNTING, "--max-tokens", "6"]) == 0
    pieces = [(step, text) for step, text in out.writes if text.strip()]
    assert len({step for step, _ in pieces}) >= 3, f"text came in at too few steps: {pieces}"
    assert all(step in out.flushes for step, _ in pieces), "a piece was written but not flushed at its step"
    assert pieces[0][0] < engine.num_steps, "the first piece came only after the last step"
    assert "".join(text for _, text in out.writes).endswith("\n")
