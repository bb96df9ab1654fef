"""A float16 KV pool under a float32 model (`--kv-cache-dtype float16`): twice the tokens in the same memory,
refused where the device's kernels read the model's own dtype, and a prefill chunk attending over its own
new K/V as the pool holds them (rounded), so that what a later read of those pages sees is what the chunk
saw. The kernels' side (reads, rounding on write, batch invariance) is in test_paged_kernel.py and
test_decoder_layer.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_engine, tiny_model

from kvfence.config import EngineConfig
from kvfence.engine.builder import pool_dtype
from kvfence.model import attention
from kvfence.model.attention import LayerAttention, PrefillSeq
from kvfence.units import cdiv

TOKENS, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 10, 4, 2, 16, 4


def test_a_float16_pool_holds_twice_the_tokens_in_the_same_memory() -> None:
    model = tiny_model()
    pools = {
        kv: make_engine(model, num_pages=None, kv_cache_memory=2**20, kv_cache_dtype=kv).pool
        for kv in ("auto", "float16")
    }
    assert pools["auto"].kv.dtype == torch.float32 and pools["float16"].kv.dtype == torch.float16
    assert pools["float16"].num_pages == 2 * pools["auto"].num_pages
    assert pools["float16"].token_bytes * 2 == pools["auto"].token_bytes


def test_a_float16_pool_is_refused_where_the_device_reads_the_model_dtype() -> None:
    config = EngineConfig(kv_cache_dtype="float16")
    on_cpu = SimpleNamespace(dtype=torch.float32, device=torch.device("cpu"))
    assert pool_dtype(config, on_cpu) == torch.float16  # type: ignore[arg-type]
    on_cuda = SimpleNamespace(dtype=torch.float32, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="CPU only"):
        pool_dtype(config, on_cuda)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="fp8")


def _chunk_both_ways() -> tuple[torch.Tensor, torch.Tensor]:
    """One 10-token chunk's attention with nothing cached (its own new K/V) and over the float16 pages
    the same K/V were written to (as a chunk after a prefix-cache hit reads them)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=gen) * 4 for _ in range(2))
    pages = cdiv(TOKENS, PAGE_SIZE)
    k_cache, v_cache = (
        torch.zeros(pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.float16) for _ in range(2)
    )
    k_cache.view(-1, KV_HEADS, HEAD_DIM)[:TOKENS] = k.half()
    v_cache.view(-1, KV_HEADS, HEAD_DIM)[:TOKENS] = v.half()
    spec = LayerAttention(scale=HEAD_DIM**-0.5, window=0)
    fresh = attention.prefill(q, k, v, k_cache, v_cache, PrefillSeq(0, TOKENS, TOKENS, None), spec)
    table = torch.arange(pages)
    from_pages = attention.prefill(q, k, v, k_cache, v_cache, PrefillSeq(0, TOKENS, TOKENS, table), spec)
    return fresh, from_pages


def test_a_chunk_sees_its_own_k_and_v_as_the_pool_holds_them(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh, from_pages = _chunk_both_ways()
    assert (fresh - from_pages).abs().max() < 1e-6  # the same values; only SDPA's masking path differs
    # Unrounded, the chunk would attend over values no later read of its pages gives back.
    monkeypatch.setattr(attention, "as_stored", lambda x, cache: x)
    fresh, from_pages = _chunk_both_ways()
    assert (fresh - from_pages).abs().max() > 1e-4
