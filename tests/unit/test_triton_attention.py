"""The Triton paged decode attention under Triton's CPU interpreter, against a float64 reference.

TRITON_INTERPRET=1 must be set before triton is first imported, so this module sets it at import (it only
affects Triton, which nothing else in the unit tests uses). Skipped, with the reason, where triton is not
installed (requirements-test.txt pins it; the CPU wheel's interpreter runs on CPU tensors).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton", reason="triton is not installed: pip install -r requirements-test.txt")

from kvfence.model import triton_attention  # noqa: E402

SCALE = 16**-0.5  # the cases below with head_dim 16


def reference(q, k_cache, v_cache, tables, lens, window=0):  # type: ignore[no-untyped-def]
    """Float64 attention over each row's pages, gathered and cut at its length (and its window)."""
    rows, heads, _ = q.shape
    group = heads // k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(rows):
        n = int(lens[row])
        first = max(0, n - window) if window else 0
        keys = k_cache[tables[row]].flatten(0, 1)[first:n].double().repeat_interleave(group, dim=1)
        values = v_cache[tables[row]].flatten(0, 1)[first:n].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[row].double(), keys) * q.shape[-1] ** -0.5
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def assert_near(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Float32 accumulation against float64: within float32 rounding of a softmax-weighted sum."""
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def random_case(
    lens: list[int], heads: int, kv_heads: int, head_dim: int, page_size: int, num_pages: int = 40
) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(sum(lens) + heads)
    k_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_pages, page_size, kv_heads, head_dim, generator=gen)
    width = max(-(-n // page_size) for n in lens)
    pages = torch.randperm(num_pages, generator=gen)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    return q, k_cache, v_cache, pages.long(), torch.tensor(lens, dtype=torch.long)


@pytest.fixture(scope="module")
def kernel() -> triton_attention.TritonPagedDecode:
    found, why = triton_attention.load("cpu")
    assert found is not None, why
    return found


@pytest.mark.parametrize(
    ("lens", "heads", "kv_heads", "head_dim", "page_size"),
    [
        ([1, 5, 8, 13], 4, 4, 16, 4),  # MHA; one token, partial and full last pages
        ([7, 16, 3], 6, 2, 16, 8),  # GQA, group of 3 (padded to 4 inside the kernel)
        ([20, 1], 4, 1, 24, 16),  # MQA; a head_dim that is not a power of two
        ([9, 2, 11], 9, 3, 64, 5),  # SmolLM2's heads; a page size that is not a power of two
    ],
)
def test_matches_float64_reference(
    kernel: triton_attention.TritonPagedDecode,
    lens: list[int],
    heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
) -> None:
    q, k_cache, v_cache, tables, context_lens = random_case(lens, heads, kv_heads, head_dim, page_size)
    out = kernel(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5)
    assert out.dtype == torch.float32
    assert_near(out, reference(q, k_cache, v_cache, tables, context_lens))


@pytest.mark.parametrize("window", [1, 4, 6, 50])
def test_a_sliding_window_reads_only_its_last_positions(
    kernel: triton_attention.TritonPagedDecode, window: int
) -> None:
    """Within a page, on a boundary, across pages, wider than the context; pages wholly before a row's
    window hold NaN, so reading one would show."""
    q, k_cache, v_cache, tables, lens = random_case([1, 5, 13, 20], 4, 2, 16, 4)
    expected = reference(q, k_cache, v_cache, tables, lens, window)
    for row, n in enumerate(lens.tolist()):
        before = tables[row, : max(0, n - window) // 4]
        k_cache[before], v_cache[before] = float("nan"), float("nan")
    assert_near(kernel(q, k_cache, v_cache, tables, lens, SCALE, window), expected)


def test_reads_in_place_from_a_layer_view_in_int32_tables(kernel: triton_attention.TritonPagedDecode) -> None:
    """The pool's layer view (strided into [layers, 2, ...]) and int32 tables, as a CUDA graph's buffers."""
    q, k_cache, v_cache, tables, lens = random_case([6, 3], 4, 2, 16, 4)
    pool = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # [layers, 2, pages, ps, kvh, hd]
    out = kernel(q, pool[1, 0], pool[1, 1], tables.int(), lens.int(), SCALE)
    assert_near(out, reference(q, k_cache, v_cache, tables, lens))


def test_a_row_does_not_depend_on_its_batch(kernel: triton_attention.TritonPagedDecode) -> None:
    q, k_cache, v_cache, tables, lens = random_case([5, 12, 9], 4, 2, 16, 4)
    batched = kernel(q, k_cache, v_cache, tables, lens, SCALE)
    solo = kernel(q[1:2], k_cache, v_cache, tables[1:2], lens[1:2], SCALE)
    assert torch.equal(batched[1], solo[0])


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
def test_never_reads_past_the_table_or_the_pool(kernel: triton_attention.TritonPagedDecode) -> None:
    """A length beyond the table is cut at the table; a page id outside the pool is read as nothing."""
    q, k_cache, v_cache, tables, lens = random_case([8, 8], 4, 2, 16, 4)
    too_long = kernel(q, k_cache, v_cache, tables, torch.tensor([8, 99]), SCALE)
    torch.testing.assert_close(too_long, kernel(q, k_cache, v_cache, tables, lens, SCALE))
    outside = tables.clone()
    outside[0] = k_cache.shape[0] + 5
    # Read as nothing: the row comes out NaN, aborted as non-finite, not a leak.
    assert kernel(q, k_cache, v_cache, outside, lens, SCALE)[0].isnan().all()
