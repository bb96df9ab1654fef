"""Shared fixtures: tiny randomly initialised models (fast unit tests) and the real SmolLM2 (correctness);
and, around every test module, the processes it started killed when it ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import signal
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from starlette.types import ASGIApp

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.engine.graphs import DecodeGraphRunner, Replay
from kvfence.harness.procs import descendants, live_command
from kvfence.harness.server import serving as serve_app
from kvfence.model.gguf import GGUFModel, ModelConfig, QuantizedWeight, load_gguf, read_blocks
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.pins import default_model_path
from kvfence.request import Request
from kvfence.units import cdiv

# Lives as long as the process that started it, and restarts itself if killed: never a test's leftover.
_KEPT = ("multiprocessing.resource_tracker",)


# Modules whose tests share one module-scoped cluster (a fixture split over xdist workers would start one in
# each, two on two cores): xdist sends each of them whole to one worker, its tests in order. Not xdist's own
# `--dist loadgroup`: its groups rename items (item._nodeid), which pytest 9 no longer reads.
ONE_WORKER_MODULES = frozenset(
    {"tests/integration/test_ray_serve.py", "tests/integration/test_ray_disagg.py"}
)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under `-n N` (xdist's `load`): every test its own unit of work, but each module above one unit."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneWorkerModules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return OneWorkerModules(config, log)


@pytest.fixture(scope="module", autouse=True)
def no_leftovers() -> Iterator[None]:
    """Every process a module started below this one that is still alive when the module ends (a test
    that failed or timed out before its cleanup) is killed, with its process group, and named in a warning.
    Orphans (re-parented away from this tree) are the suite runner's to find (tests/suite.py)."""
    before = set(descendants(os.getpid()))
    yield
    for pid in descendants(os.getpid()):
        command = live_command(pid)
        if pid in before or command is None or any(kept in command for kept in _KEPT):
            continue
        warnings.warn(f"killing a process the module left running: {pid} {command[:200]}", stacklevel=1)
        with contextlib.suppress(OSError):
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGKILL)


TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    context_length=512,
    tie_word_embeddings=False,
)
# The same shape as each architecture: what the forward does differently is switched on by the config and
# by the tensors a layer holds (tiny_tensors adds them).
TINY_ARCHS = {
    "llama": TINY,
    "qwen2": replace(TINY, architecture="qwen2"),
    "qwen3": replace(TINY, architecture="qwen3"),
    "gemma3": replace(
        TINY,
        architecture="gemma3",
        activation="gelu_tanh",
        embedding_scale=TINY.hidden_size**0.5,
        query_scale=TINY.head_dim**-0.5,
        rope_theta=1e6,
        sliding_window=6,
        local_layers=frozenset({0}),
        local_rope_theta=10000.0,
    ),
}


def tiny_tensors(seed: int = 0, config: ModelConfig = TINY) -> dict[str, torch.Tensor]:
    """Random weights under their GGUF names, scaled so that greedy outputs depend strongly on every
    context token."""
    gen = torch.Generator().manual_seed(seed)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads * config.head_dim
    q = config.num_heads * config.head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    # An untied random LM head: tied to the embedding, argmax would mostly repeat the input token.
    tensors = {
        "token_embd.weight": torch.randn(config.vocab_size, h, generator=gen),
        "output.weight": torch.randn(config.vocab_size, h, generator=gen),
        "output_norm.weight": torch.ones(h),
    }
    for layer in range(config.num_layers):
        p = f"blk.{layer}."
        tensors |= {
            p + "attn_norm.weight": torch.ones(h),
            p + "ffn_norm.weight": torch.ones(h),
            p + "attn_q.weight": w(q, h) * 4,
            p + "attn_k.weight": w(kv, h) * 4,
            p + "attn_v.weight": w(kv, h),
            p + "attn_output.weight": w(h, q),
            p + "ffn_gate.weight": w(i, h),
            p + "ffn_up.weight": w(i, h),
            p + "ffn_down.weight": w(h, i),
        }
        if config.architecture == "qwen2":
            tensors |= {
                p + f"attn_{x}.bias": torch.randn(n, generator=gen)
                for x, n in zip("qkv", (q, kv, kv), strict=True)
            }
        if config.architecture in ("qwen3", "gemma3"):
            d = config.head_dim
            tensors |= {p + f"attn_{x}_norm.weight": 1 + 0.2 * torch.randn(d, generator=gen) for x in "qk"}
        if config.architecture == "gemma3":
            tensors |= {
                p + f"{x}.weight": 1 + 0.2 * torch.randn(h, generator=gen)
                for x in ("post_attention_norm", "post_ffw_norm")
            }
    return tensors


def quantized_blocks(weight: torch.Tensor, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """`weight` [out, in] quantized by gguf-py, as a file stores it: [blocks, bytes per block]."""
    return gguf.quants.quantize(weight.numpy(), kind).reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])


def quantize(
    tensors: dict[str, torch.Tensor], kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_1
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """The projections and LM head quantized by gguf-py, split as the loader splits a GGUF file: the other
    tensors, and the quantized weights' codes (GGUFModel.quantized)."""
    dense, quantized = dict(tensors), {}
    for name, weight in tensors.items():
        if weight.dim() == 2 and name != "token_embd.weight":
            blocks = read_blocks(kind, tuple(weight.shape), quantized_blocks(weight, kind))
            assert blocks is not None
            quantized[name] = QuantizedWeight(*(torch.from_numpy(part) for part in blocks))
            del dense[name]
    return dense, quantized


def dequantized(
    tensors: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight]
) -> dict[str, torch.Tensor]:
    """Every weight as float32: what a model without the packed kernel multiplies by."""
    return tensors | {name: q.dequantize() for name, q in quantized.items()}


def tiny_model(
    seed: int = 0,
    config: ModelConfig = TINY,
    decode_attention: str = "auto",
    decode_matmul: str | None = None,
    activation_dtype: str = "float32",
) -> Transformer:
    """`decode_matmul` set: the weights quantized (Q4_1), and that choice of decode matmul."""
    if decode_matmul is None:
        return Transformer(config, tiny_tensors(seed, config), decode_attention)
    tensors, quantized = quantize(tiny_tensors(seed, config))
    return Transformer(config, tensors, decode_attention, quantized, decode_matmul, activation_dtype)


@pytest.fixture(scope="session")
def tiny() -> Transformer:
    return tiny_model()


@pytest.fixture(scope="session", params=sorted(TINY_ARCHS))
def arch_tiny(request: pytest.FixtureRequest) -> Transformer:
    """The tiny model in each architecture's shape (the tests using it run once per architecture)."""
    return tiny_model(config=TINY_ARCHS[request.param])


def make_engine(
    model: Transformer, engine_cls: type[LLMEngine] = LLMEngine, **overrides: object
) -> LLMEngine:
    """A tiny-model engine; `engine_cls` HandoffEngine for a prefill or decode worker's."""
    settings: dict[str, object] = {
        "num_pages": 64,
        "page_size": 4,
        "max_num_batched_tokens": 64,
        "max_model_len": 48,
    }
    settings.update(overrides)
    return engine_cls(EngineConfig(**settings), model, log=lambda _: None)  # type: ignore[arg-type]


class FakeGraphs:
    """A capture that records what it is given and replays by calling it again: what a CUDA graph does
    when the function reads only the static buffers."""

    def __init__(self) -> None:
        self.captured: list[Replay] = []
        self.replays = 0

    def capture(self, fn: Replay) -> Replay:
        self.captured.append(fn)
        fn()  # a capture runs the function once, as the CUDA backend's warm-up does

        def replay() -> torch.Tensor:
            self.replays += 1
            return fn()

        return replay


def with_fake_graphs(engine: LLMEngine) -> FakeGraphs:
    """Decode steps of `engine` (built with decode_graphs=True: its pool has the scratch page) through a
    DecodeGraphRunner over a fake capture, as a CUDA engine's run through captured graphs."""
    fake = FakeGraphs()
    width = cdiv(engine.max_model_len, engine.pool.page_size)
    engine.runner.graphs = DecodeGraphRunner(
        engine.runner.model, engine.pool, engine.config.max_num_seqs, width, fake
    )
    return fake


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """One torch thread in this process for the test: beside worker processes, a load generator or an HTTP
    server on a 2-core machine, two OpenMP threads spin on each other's barriers and a step can take 10 to
    40 times longer. Restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2() -> GGUFModel:
    """The real SmolLM2-135M-Instruct weights, float32, loaded once per test session."""
    return load_gguf(default_model_path())


@pytest.fixture(scope="session")
def hf_smollm2(smollm2: GGUFModel) -> torch.nn.Module:
    """transformers' own load of the same SmolLM2 GGUF (its GGUF support dequantizes it), float32, once per
    session: the golden reference (about 15 s to load)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2.path.parent), gguf_file=smollm2.path.name, dtype=torch.float32
    )
    return model.eval()


def real_engine(gguf: GGUFModel, activation_dtype: str = "float32", **overrides: object) -> LLMEngine:
    """An engine over real weights, on the exact float32 path unless `activation_dtype` says otherwise:
    the golden tests compare it with transformers' float32 (serving's default is the int8 fast path)."""
    settings: dict[str, object] = {"num_pages": 256, "max_model_len": 2048}
    settings.update(overrides)
    engine = LLMEngine(
        EngineConfig(**settings),
        Transformer.from_gguf(gguf, activation_dtype=activation_dtype),  # type: ignore[arg-type]
        Tokenizer.from_gguf(gguf),
        log=lambda _: None,
    )
    engine.model_file = gguf.path
    return engine


class LogitsRecorder:
    """Collects the logits of every sampled step per request id (the engine's runner hook)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: dict[str, list[torch.Tensor]] = {}
        engine.runner.logits_observer = self

    def __call__(self, requests: list[Request], logits: torch.Tensor) -> None:
        for request, row in zip(requests, logits, strict=True):
            self.steps.setdefault(request.request_id, []).append(row.clone())


def assert_same_greedy(
    ours: list[int],
    ours_logits: list[torch.Tensor],
    ref: list[int],
    ref_logits: list[torch.Tensor],
    atol: float = 1e-4,
    rtol: float = 2e-5,
    tie_gap: float = 1e-3,
) -> None:
    """Greedy tokens equal and, at every step, logits within `atol` or `rtol` of the step's largest logit
    magnitude, whichever is more (float32 against float32 in different reduction orders: SmolLM2's and
    Gemma's logits reach 20-60). A divergence is accepted only where the reference's own top-2 gap is
    below `tie_gap` (a near-tie); comparison stops there, as the contexts differ from then on."""
    assert len(ours) == len(ref) and len(ours_logits) == len(ours)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        diff = (ours_logits[step] - ref_logits[step]).abs().max().item()
        bound = max(atol, rtol * ref_logits[step].abs().max().item())
        assert diff <= bound, f"step {step}: logits differ by {diff:.2e} (bound {bound:.2e})"
        if a != b:
            top2 = torch.topk(ref_logits[step], 2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < tie_gap, f"step {step}: token {a} != {b} with a top-2 gap of {gap:.2e}"
            return


def serving(app: ASGIApp) -> AbstractContextManager[str]:
    """`app` under uvicorn on a free loopback port, in a thread (kvfence.harness.server); yields its URL."""
    return serve_app(app)
