"""A prefill chunk over cached pages (kvfence.model.attention.prefill) against attention worked out in
float64 over the same positions: causal over the whole context, or a sliding window that reads no page
before the earliest position its first query sees; a whole prompt (nothing cached) causal, its queries in
one block and in several."""

from __future__ import annotations

import pytest
import torch

from kvfence.model.attention import QUERY_BLOCK, LayerAttention, PrefillSeq, prefill

PAGE, HEADS, KV_HEADS, HD = 16, 4, 2, 8


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, spec: LayerAttention
) -> torch.Tensor:
    """q [n, heads, hd] at the context's last n positions over keys/values [ctx, kv_heads, hd]."""
    n, ctx = q.shape[0], keys.shape[0]
    group = HEADS // KV_HEADS
    k, v = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * spec.scale
    p, j = torch.arange(ctx - n, ctx)[:, None], torch.arange(ctx)[None, :]
    visible = (j <= p) & ((p - j < spec.window) if spec.window else True)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [0, 40])
def test_a_chunk_over_cached_pages_is_attention_over_its_visible_positions(window: int) -> None:
    torch.manual_seed(0)
    ctx, n_new, pages = 150, 22, 16
    table = torch.randperm(pages)[: -(-ctx // PAGE)]  # pages out of order, as a pool hands them out
    k_cache, v_cache = torch.randn(2, pages, PAGE, KV_HEADS, HD).unbind(0)
    keys = k_cache[table].flatten(0, 1)[:ctx].clone()
    values = v_cache[table].flatten(0, 1)[:ctx].clone()
    if window:  # every page wholly before the first query's window: poison (NaN) that must not be read
        first_seen = ctx - n_new - window + 1
        for index in range(first_seen // PAGE):
            k_cache[table[index]], v_cache[table[index]] = float("nan"), float("nan")
    q = torch.randn(n_new, HEADS, HD)
    spec = LayerAttention(scale=HD**-0.5, window=window)
    k_new = keys[ctx - n_new :]  # the chunk's own K/V, already stored in its pages
    seq = PrefillSeq(0, n_new, ctx, table)
    out = prefill(q, k_new, values[ctx - n_new :], k_cache, v_cache, seq, spec)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, spec), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [5, QUERY_BLOCK, 2 * QUERY_BLOCK + 7])
def test_a_whole_prompt_in_blocks_of_queries_is_causal_attention(n: int) -> None:
    """Nothing cached: the chunk's own K/V, its queries in blocks (`QUERY_BLOCK`) each over the keys up to
    its last query, against float64 causal attention."""
    torch.manual_seed(1)
    q, keys, values = torch.randn(n, HEADS, HD), torch.randn(n, KV_HEADS, HD), torch.randn(n, KV_HEADS, HD)
    k_cache = v_cache = torch.empty(1, PAGE, KV_HEADS, HD)  # float32 pool: nothing read from it
    spec = LayerAttention(scale=HD**-0.5, window=0)
    out = prefill(q, keys, values, k_cache, v_cache, PrefillSeq(0, n, n, None), spec)
    torch.testing.assert_close(out.double(), reference(q, keys, values, spec), rtol=1e-5, atol=1e-5)
