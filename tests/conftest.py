"""Shared fixtures: a tiny randomly initialised Llama (fast unit tests) and the real SmolLM2 (correctness)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

import gguf
import numpy as np
import pytest
import torch
from fastapi import FastAPI

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.server import serving as serve_app
from kvfence.model.gguf import (
    GGUFModel,
    ModelConfig,
    QuantizedWeight,
    load_gguf,
    read_blocks,
)
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.pins import default_model_path
from kvfence.request import Request

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


def tiny_tensors(seed: int = 0, config: ModelConfig = TINY) -> dict[str, torch.Tensor]:
    """Random weights scaled so that greedy outputs depend strongly on every context token."""
    gen = torch.Generator().manual_seed(seed)
    h, i, kv = config.hidden_size, config.intermediate_size, config.num_kv_heads * config.head_dim

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    # An untied random LM head: tied to the embedding, argmax would mostly repeat the input token.
    tensors = {
        "embed_tokens.weight": torch.randn(config.vocab_size, h, generator=gen),
        "lm_head.weight": torch.randn(config.vocab_size, h, generator=gen),
        "norm.weight": torch.ones(h),
    }
    for layer in range(config.num_layers):
        p = f"layers.{layer}."
        tensors |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(h, h) * 4,
            p + "self_attn.k_proj.weight": w(kv, h) * 4,
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, h),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
        }
    return tensors


class FakeReaderTensor:
    """What `read_blocks` reads of a gguf.ReaderTensor: the type, ggml's (reversed) shape, the raw blocks."""

    def __init__(self, weight: torch.Tensor, kind: gguf.GGMLQuantizationType) -> None:
        self.tensor_type = kind
        self.shape = np.array(list(reversed(weight.shape)))
        self.data = gguf.quants.quantize(weight.numpy(), kind)


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """codes * scales + offsets, block by block: the float32 weight a QuantizedWeight stands for."""
    n, k = q.codes.shape
    return (q.codes.float().view(n, k // 32, 32) * q.scales[..., None] + q.offsets[..., None]).view(n, k)


def quantize(
    tensors: dict[str, torch.Tensor], kind: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.Q4_1
) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """The projections and LM head quantized by gguf-py as a GGUF file holds them: the dequantized tensors
    (what the loader would return) and their codes (what it keeps in GGUFModel.quantized)."""
    dense, quantized = dict(tensors), {}
    for name, weight in tensors.items():
        if name.endswith("proj.weight") or name == "lm_head.weight":
            fake = FakeReaderTensor(weight, kind)
            dense[name] = torch.from_numpy(gguf.quants.dequantize(fake.data, kind).reshape(weight.shape))
            blocks = read_blocks(fake)  # type: ignore[arg-type]
            assert blocks is not None
            quantized[name] = QuantizedWeight(*(torch.from_numpy(part) for part in blocks))
    return dense, quantized


def tiny_model(
    seed: int = 0,
    config: ModelConfig = TINY,
    decode_attention: str = "auto",
    decode_matmul: str | None = None,
) -> Transformer:
    """`decode_matmul` set: the weights quantized (Q4_1), and that choice of decode matmul."""
    if decode_matmul is None:
        return Transformer(config, tiny_tensors(seed, config), decode_attention)
    tensors, quantized = quantize(tiny_tensors(seed, config))
    return Transformer(config, tensors, decode_attention, quantized, decode_matmul)


@pytest.fixture(scope="session")
def tiny() -> Transformer:
    return tiny_model()


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


def real_engine(gguf: GGUFModel, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {"num_pages": 256, "max_model_len": 2048}
    settings.update(overrides)
    engine = LLMEngine(
        EngineConfig(**settings),
        Transformer.from_gguf(gguf),  # type: ignore[arg-type]
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
    tie_gap: float = 1e-3,
) -> None:
    """Greedy tokens equal and logits within `atol` at every step. A divergence is accepted only where the
    reference's own top-2 gap is below `tie_gap` (a near-tie); comparison stops there, as the contexts differ
    from then on."""
    assert len(ours) == len(ref) and len(ours_logits) == len(ours)
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        diff = (ours_logits[step] - ref_logits[step]).abs().max().item()
        assert diff <= atol, f"step {step}: logits differ by {diff:.2e}"
        if a != b:
            top2 = torch.topk(ref_logits[step], 2).values
            gap = (top2[0] - top2[1]).item()
            assert gap < tie_gap, f"step {step}: token {a} != {b} with a top-2 gap of {gap:.2e}"
            return


def serving(app: FastAPI) -> AbstractContextManager[str]:
    """`app` under uvicorn on a free loopback port, in a thread (kvfence.harness.server); yields its URL."""
    return serve_app(app)
