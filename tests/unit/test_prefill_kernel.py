"""The C prefill-attention kernel (`PagedDecodeKernel.prefill`): a chunk's queries over its pages against
attention worked out in float64, on every build; a row's bits the same however the prompt is chunked; the
pages before a window never read; a bad table refused before anything is read."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_attention_prefill import HEADS, KV_HEADS, PAGE, reference

from kvfence.model import paged_kernel
from kvfence.model.attention import LayerAttention

CTX, PAGES = 150, 16
BUILDS = {"this CPU": {}, "portable": {"portable": True}, "avx2": {"avx512": False}}


def kernel(build: str = "this CPU") -> paged_kernel.PagedDecodeKernel:
    loaded, why = paged_kernel.load(**BUILDS[build])
    assert loaded is not None, why  # CI has a C compiler: a silent fallback would leave the kernel untested
    return loaded


def pool(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pages out of order (as a pool hands them out) holding CTX positions of random K and V."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randperm(PAGES, generator=gen)[: -(-CTX // PAGE)].contiguous()
    k_cache, v_cache = torch.randn(2, PAGES, PAGE, KV_HEADS, head_dim, generator=gen).to(dtype).unbind(0)
    return table, k_cache.contiguous(), v_cache.contiguous()


def stored(cache: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return cache[table].flatten(0, 1)[:CTX].float()


@pytest.mark.parametrize("build", list(BUILDS))
@pytest.mark.parametrize("head_dim", [8, 64])  # below and at a whole register pass of p . v
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("window", [0, 40])
def test_a_chunk_is_attention_over_its_visible_positions(
    build: str, head_dim: int, dtype: torch.dtype, window: int
) -> None:
    table, k_cache, v_cache = pool(head_dim, dtype)
    keys, values = stored(k_cache, table), stored(v_cache, table)
    n_new = 37
    if window:  # every page wholly before the first query's window: poison (NaN) that must not be read
        for index in range((CTX - n_new - window + 1) // PAGE):
            k_cache[table[index]], v_cache[table[index]] = float("nan"), float("nan")
    q = torch.randn(n_new, HEADS, head_dim, generator=torch.Generator().manual_seed(1))
    spec = LayerAttention(scale=head_dim**-0.5, window=window)
    out = kernel(build).prefill(q, k_cache, v_cache, table, CTX - n_new, spec.scale, window)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), reference(q, keys, values, spec), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 40])
def test_a_row_has_the_same_bits_however_the_prompt_is_chunked(window: int) -> None:
    table, k_cache, v_cache = pool(64, torch.float16)
    q = torch.randn(CTX, HEADS, 64, generator=torch.Generator().manual_seed(2))
    prefill = kernel().prefill
    whole = prefill(q, k_cache, v_cache, table, 0, 0.125, window)
    for bounds in ([0, 7, 93, CTX], [0, 64, 128, CTX], [0, 1, 2, 100, CTX]):
        chunks = [
            prefill(q[a:b], k_cache, v_cache, table, a, 0.125, window) for a, b in itertools.pairwise(bounds)
        ]
        assert torch.equal(torch.cat(chunks), whole), bounds


@pytest.mark.parametrize("page, pages", [(PAGES, None), (-1, None), (0, 2)])
def test_a_bad_table_is_refused(page: int, pages: int | None) -> None:
    table, k_cache, v_cache = pool(8, torch.float32)
    table = table[:pages].clone() if pages else table.clone()
    table[0] = page
    q = torch.randn(CTX, HEADS, 8)
    with pytest.raises(paged_kernel.PagedAttentionError, match="outside the pool"):
        kernel().prefill(q, k_cache, v_cache, table, 0, 0.125)
