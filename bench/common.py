"""Shared benchmark helpers: weights, prompts, the offline kvfence and HF runners, metrics, table rows, JSON.

What only benchmark scripts share lives here; what tests or the lab use too (clusters, load, tables, SSE)
lives in kvfence.harness. Nothing below is duplicated in the scripts. Times come from
`time.monotonic()`, the clock `Request` uses for arrival_time / first_token_time / finish_time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import platform
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.load import WORDS
from kvfence.harness.streams import GREEDY, Sampling, drive
from kvfence.model.gguf import GGUFModel
from kvfence.model.hf_load import load_model
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.pins import code_info, default_model_path
from kvfence.request import Request
from kvfence.sampling import SamplingParams

T = TypeVar("T")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: int
    max_tokens: int

    def scaled(self, num_requests: int) -> Workload:
        return Workload(self.name, num_requests, self.prompt_len, self.max_tokens)


W1 = Workload("W1", num_requests=32, prompt_len=64, max_tokens=128)  # decode-heavy
W2 = Workload("W2", num_requests=32, prompt_len=512, max_tokens=16)  # prefill-heavy
WORKLOADS = {w.name: w for w in (W1, W2)}


# ---- weights, engines, prompts ---------------------------------------------------------------------------


DEFAULT_THREADS = 2  # see THREADS_HELP
THREADS_HELP = (
    "torch intra-op threads (default 2, the engine's default; kvfence and HF alike). On a quiet 2-core "
    "machine two threads are faster (c16 decode 121 vs 163 ms/step, measured), but two OpenMP threads slow "
    "down up to 10x whenever another process takes a core: on a shared machine --threads 1 degrades "
    "gracefully."
)


BENCH_WINDOW = 4096  # tokens: every workload's prompt and output fit


def load_weights(threads: int | None = None, path: Path | None = None) -> GGUFModel:
    """Load a GGUF file or a Hugging Face directory (default: the packaged SmolLM2) in float32, once; build
    every engine from it. `threads` (None: leave torch's setting alone) is global, so HF transformers in the
    same process runs with the same number."""
    if threads is not None:
        torch.set_num_threads(threads)
    started = time.perf_counter()
    gguf = load_model(path or default_model_path())
    seconds = time.perf_counter() - started
    print(f"loaded {gguf.path.name} in {seconds:.1f}s; torch threads {torch.get_num_threads()}")
    return gguf


def build_engine(
    gguf: GGUFModel, isolation: bool = True, model: Transformer | None = None, **overrides: Any
) -> LLMEngine:
    """An engine with the default config (prefix caching on, 512 MiB pool, a window of at most
    BENCH_WINDOW: Gemma's 32k would not fit the pool) over already loaded weights. Pass `model` to share
    one Transformer (it holds no per-engine state) between engines."""
    overrides.setdefault("max_model_len", min(BENCH_WINDOW, gguf.config.context_length))
    config = EngineConfig(isolation=isolation, **overrides)
    model = model or Transformer.from_gguf(gguf)
    return LLMEngine(config, model, Tokenizer.from_gguf(gguf), log=lambda _: None)


def make_prompts(tokenizer: Tokenizer, count: int, length: int, salt: int = 0) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids: numbered sentences of seeded words.

    Each prompt starts with its own number (and `salt`), so no two share even a first page and the prefix
    cache never turns one request's prefill into a hit for another; a new salt gives a fresh set."""
    prompts = []
    for index in range(count):
        rng = random.Random(f"{salt}-{index}")
        sentences, ids = [f"Request {salt}-{index}."], []
        while len(ids) < length:
            sentences.append(f"Sentence {len(sentences)}: " + " ".join(rng.choices(WORDS, k=12)) + ".")
            ids = tokenizer.encode(" ".join(sentences))
        prompts.append(ids[:length])
    assert len({tuple(p) for p in prompts}) == count, "prompts must be distinct"
    return prompts


# ---- the shared machine --------------------------------------------------------------------------------

CONTENDED = 0.15  # a run during which other processes used more than this share of all CPUs is suspect


def _cpu_seconds() -> tuple[float, float, float]:
    """(now, busy CPU seconds of the whole machine incl. steal, CPU seconds of this process)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    own = os.times()
    busy = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, own.user + own.system


class ForeignCpu:
    """How much of the machine other processes (and the hypervisor) used since construction: 0.0 means
    this process had every core to itself, 0.5 that others took half of all cores. Torch's OpenMP threads
    slow down far more than proportionally when they have to share cores, so a contended run is noise."""

    def __init__(self) -> None:
        self._start = _cpu_seconds()

    def share(self) -> float:
        now, busy, own = _cpu_seconds()
        t0, busy0, own0 = self._start
        elapsed = max(now - t0, 1e-9)
        return max(0.0, ((busy - busy0) - (own - own0)) / (elapsed * (os.cpu_count() or 1)))


def wait_for_quiet(max_wait_s: float = 90.0, threshold: float = CONTENDED) -> float:
    """Sleep (1 s probes) until other processes use less than `threshold` of the CPUs; returns the share
    seen last. Gives up after `max_wait_s`: the run then goes ahead and its foreign_cpu flags it."""
    started = time.monotonic()
    for probes in itertools.count():
        probe = ForeignCpu()
        time.sleep(1.0)
        share = probe.share()
        waited = time.monotonic() - started
        if share < threshold or waited > max_wait_s:
            if probes:
                print(f"  (waited {waited:.0f}s for a quiet machine; others now at {share * 100:.0f}%)")
            return share
        if probes % 15 == 0:
            print(f"  (waiting: other processes use {share * 100:.0f}% of the CPUs)", flush=True)
    raise AssertionError("unreachable")


def contention_threshold() -> float:
    """Others' CPU share above which they must have taken cores our torch threads needed: CONTENDED plus
    the share of cores we leave idle (with 1 thread on 2 cores another process may use one core freely)."""
    cpus = os.cpu_count() or 1
    return CONTENDED + max(0, cpus - torch.get_num_threads()) / cpus


def quietly(run: Callable[[], T], contention: Callable[[T], float], retries: int) -> tuple[T, int]:
    """Wait for a quiet machine, then `run`; redo it (up to `retries` times) while `contention` of the
    result exceeds contention_threshold(). Returns the last result and how many were discarded."""
    threshold = contention_threshold()
    for attempt in range(retries + 1):
        wait_for_quiet(threshold=threshold)
        result = run()
        share = contention(result)
        if share <= threshold or attempt == retries:
            return result, attempt
        print(
            f"  (discarded: other processes used {share * 100:.0f}% of the CPUs during the run)", flush=True
        )
    raise AssertionError("unreachable")


# ---- metrics ---------------------------------------------------------------------------------------------


@dataclass
class RequestTiming:
    """Seconds from the request's arrival (when it was handed to the engine / its batch started)."""

    ttft: float
    tpot: float  # mean inter-token time after the first token
    latency: float  # arrival to last token
    num_output: int


@dataclass
class RunResult:
    label: str
    concurrency: int
    num_requests: int
    wall_s: float
    output_tokens: int
    timings: list[RequestTiming] = field(repr=False)
    step_s: float = 0.0  # summed engine.step() wall time (kvfence only)
    fence_s: float = 0.0  # fence validation time within those steps (kvfence only)
    steps: int = 0
    foreign_cpu: float = 0.0  # share of the machine's CPU other processes used meanwhile (see ForeignCpu)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def pct(self, metric: str, q: float) -> float:
        return float(np.percentile([getattr(t, metric) for t in self.timings], q))

    def summary(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = {
            "label": self.label,
            "concurrency": self.concurrency,
            "num_requests": self.num_requests,
            "wall_s": self.wall_s,
            "output_tokens": self.output_tokens,
            "output_tok_per_s": self.tok_per_s,
            "steps": self.steps,
            "step_s": self.step_s,
            "fence_s": self.fence_s,
            "foreign_cpu": self.foreign_cpu,
        }
        for metric in ("ttft", "tpot", "latency"):
            for q in (50, 95):
                out[f"{metric}_p{q}_ms"] = self.pct(metric, q) * 1e3
        return out


def request_timing(request: Request) -> RequestTiming:
    assert request.first_token_time is not None and request.finish_time is not None
    n = len(request.output_token_ids)
    decode_s = request.finish_time - request.first_token_time
    return RequestTiming(
        ttft=request.first_token_time - request.arrival_time,
        tpot=decode_s / (n - 1) if n > 1 else 0.0,
        latency=request.finish_time - request.arrival_time,
        num_output=n,
    )


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


# ---- the kvfence offline runner --------------------------------------------------------------------------


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


# ---- memory bandwidth ------------------------------------------------------------------------------------


def read_bandwidth(threads: int, size: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which `threads` torch threads read a 1 GiB float32 array (a sum: one pass, no writes), the
    best of `repeats`: the ceiling a decode step reading every weight once can approach."""
    data = torch.ones(size // 4)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return size / best / 1e9


def decode_matmul_bandwidth(model: Transformer, threads: int, repeats: int = 5) -> tuple[float, float]:
    """(GB/s, MB read) of the decode matmul at one row over every projection of the model (a decode step's
    weights, the LM head included), as the C decoder layer runs it: packed codes through the packed kernel,
    16-bit weights through the 16-bit kernel over every thread; the best of `repeats`; (0, 0) when neither
    kernel runs."""
    projections = [p for layer in model.layers for p in layer.projections()] + [model.lm_head]
    calls, read = [], 0
    if model.packed_matmul is not None:
        packed = [p.packed for p in projections if p.packed is not None]
        read += sum(w.codes.numel() + 4 * (w.scales.numel() + w.offsets.numel()) for w in packed)
        calls += [(model.packed_matmul, w, w.in_features, {}) for w in packed]
    if model.half_matmul is not None:
        half = [p.dense.T for p in projections if p.packed is None and p.dense is not None]
        read += sum(2 * w.numel() for w in half)
        calls += [(model.half_matmul, w, w.shape[1], {"split": True}) for w in half]
    if not calls:
        return 0.0, 0.0
    rows = {width: torch.randn(1, width) for _, _, width, _ in calls}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            for kernel, weight, width, options in calls:
                kernel(rows[width], weight, **options)
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return read / best / 1e9, read / 1e6


# ---- HF transformers baseline ----------------------------------------------------------------------------


class StepClock:
    """A generate() streamer that only timestamps: put() is called once with the prompt, then once per step
    with the new tokens of the whole batch. The second call is the first token (prefill + first sample)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, _value: torch.Tensor) -> None:
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def load_hf_model(gguf: GGUFModel) -> torch.nn.Module:
    """transformers' float32 model of the same file or directory."""
    from transformers import AutoModelForCausalLM

    if gguf.path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.path), dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.path.parent), gguf_file=gguf.path.name, dtype=torch.float32
        )
    return model.eval()


def left_pad(prompts: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def hf_generate_batch(
    model: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int, pad_id: int
) -> list[RequestTiming]:
    """One greedy generate() over a left-padded batch; min_new_tokens=max_new_tokens, so length is exact.
    Every row of the batch shares the batch's timing (arrival = the generate() call)."""
    ids, mask = left_pad(prompts, pad_id)
    clock = StepClock()
    started = time.monotonic()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            pad_token_id=pad_id,
            streamer=clock,
        )
    finished = time.monotonic()
    assert out.shape[1] - ids.shape[1] == max_tokens
    first = clock.times[1]
    tpot = (finished - first) / (max_tokens - 1) if max_tokens > 1 else 0.0
    timing = RequestTiming(ttft=first - started, tpot=tpot, latency=finished - started, num_output=max_tokens)
    return [timing] * len(prompts)


def run_hf(
    model: torch.nn.Module, prompts: Sequence[list[int]], max_tokens: int, batch_size: int, pad_id: int
) -> RunResult:
    """Consecutive prompts in batches of `batch_size`, one generate() per batch, batches back to back."""
    timings: list[RequestTiming] = []
    gc.collect()
    foreign = ForeignCpu()
    started = time.monotonic()
    for first in range(0, len(prompts), batch_size):
        timings += hf_generate_batch(model, prompts[first : first + batch_size], max_tokens, pad_id)
    wall = time.monotonic() - started
    tokens = sum(t.num_output for t in timings)
    return RunResult("hf", batch_size, len(prompts), wall, tokens, timings, foreign_cpu=foreign.share())


# ---- output ----------------------------------------------------------------------------------------------


def median_min_max(values: Sequence[float]) -> tuple[float, float, float]:
    return float(np.median(values)), float(min(values)), float(max(values))


# A RunResult as a table row: RUN_HEADERS over run_cells (TTFT and TPOT in ms).
RUN_HEADERS = (
    "system",
    "conc",
    "reqs",
    "wall s",
    "out tok/s",
    "TTFT p50",
    "TTFT p95",
    "TPOT p50",
    "TPOT p95",
    "others %",
)


def run_cells(result: RunResult) -> list[object]:
    return [
        result.label,
        result.concurrency,
        result.num_requests,
        result.wall_s,
        result.tok_per_s,
        *(result.pct(metric, q) * 1e3 for metric in ("ttft", "tpot") for q in (50, 95)),
        f"{result.foreign_cpu * 100:.0f}",
    ]


class Verdicts:
    """The verdicts a script has given. A missed target must fail the script, not only read FAIL in its
    output: the script's main returns `exit_status()`, which is 1 once any verdict failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def record(self, name: str, passed: bool) -> str:
        """'PASS' or 'FAIL' for the check `name`; a failure is kept for the exit status."""
        if not passed:
            self.failed.append(name)
        return "PASS" if passed else "FAIL"

    def exit_status(self) -> int:
        """0 when every verdict passed; else 1, after naming the failed ones (the last line of the run)."""
        if self.failed:
            print(f"FAILED {len(self.failed)} verdict(s): {'; '.join(self.failed)}")
        return 1 if self.failed else 0


VERDICTS = Verdicts()  # the script's own: one process, one script


def verdict(name: str, passed: bool, detail: str) -> str:
    """Print and return the verdict's line; a FAIL makes `exit_status()` non-zero."""
    line = f"{VERDICTS.record(name, passed)}  {name}: {detail}"
    print(line)
    return line


def exit_status() -> int:
    """What a bench script exits with (`sys.exit(main())`): non-zero when any of its verdicts failed."""
    return VERDICTS.exit_status()


def write_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    meta = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **code_info(),  # the kvfence version and commit measured (git_dirty: uncommitted changes)
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "load_average_1_5_15m": os.getloadavg(),
    }
    path.write_text(json.dumps({"meta": meta, **payload}, indent=2, default=_jsonable))
    print(f"wrote {path}")
    return path


def _jsonable(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)  # type: ignore[call-overload]
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def add_llama_server_options(parser: argparse.ArgumentParser) -> None:
    """--llama-server and --build: where the peer's binary comes from (kvfence.harness.peers)."""
    parser.add_argument(
        "--llama-server", type=Path, help="the binary (default: $KVFENCE_LLAMA_SERVER or cache)"
    )
    parser.add_argument("--build", action="store_true", help="build llama-server if none is found (~10 min)")
