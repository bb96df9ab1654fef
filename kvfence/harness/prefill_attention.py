"""The C prefill-attention kernel's two builds side by side: float32 (KVFENCE_PREFILL_F32=1, the fallback)
and bf16 (AVX512-BF16), as kernel calls and as engines.

Contracts: `kernel_run` times one whole prompt's prefill attention (every query row in one call, over a
float16 pool in pages out of order) with a build's kernel; `engines_by_build` builds one engine per build
over the same weights with kvfence's defaults (the build is chosen when a model is made: the variable is set
around each construction only).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvfence.engine.engine import LLMEngine
from kvfence.harness.offline_engine import build_engine
from kvfence.model import paged_kernel
from kvfence.model.gguf import GGUFModel

BUILDS = {"f32": False, "bf16": True}  # the prefill kernel's build: bf16 inner products or not
PAGE = 16


@dataclass(frozen=True)
class Shape:
    """One layer's attention: SmolLM2-135M's by default."""

    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64


def kernel_run(bf16: bool, tokens: int, shape: Shape = Shape()) -> Callable[[], None]:
    """One call of the build's prefill kernel over a `tokens`-token prompt, from position 0."""
    kernel, why = paged_kernel.load(bf16=bf16)
    if kernel is None:
        raise RuntimeError(why)
    gen = torch.Generator().manual_seed(tokens)
    pages = -(-tokens // PAGE)
    table = torch.randperm(pages, generator=gen)
    cache = torch.randn(2, pages, PAGE, shape.kv_heads, shape.head_dim, generator=gen).half()
    k_cache, v_cache = cache[0].contiguous(), cache[1].contiguous()
    q = torch.randn(tokens, shape.heads, shape.head_dim, generator=gen)
    scale = shape.head_dim**-0.5

    def run() -> None:
        kernel.prefill(q, k_cache, v_cache, table, 0, scale)

    return run


def engines_by_build(gguf: GGUFModel, max_model_len: int) -> dict[str, LLMEngine]:
    """An engine per build (kvfence's defaults, no prefix caching: every prompt is prefilled whole)."""
    engines = {}
    for name, bf16 in BUILDS.items():
        before = os.environ.pop(paged_kernel.PREFILL_F32_ENV, None)
        if not bf16:
            os.environ[paged_kernel.PREFILL_F32_ENV] = "1"
        try:
            engines[name] = build_engine(gguf, max_model_len=max_model_len, enable_prefix_caching=False)
        finally:
            os.environ.pop(paged_kernel.PREFILL_F32_ENV, None)
            if before is not None:
                os.environ[paged_kernel.PREFILL_F32_ENV] = before
    return engines
