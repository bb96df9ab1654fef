"""Paged decode attention in Triton: the GPU's counterpart of the C kernel (paged_kernel.py).

Contract: `TritonPagedDecode` is a `paged_decode.PagedDecode`, as `PagedDecodeKernel` is: for each row of one
query token, attention over the first `context_lens[row]` slots of the pages `block_tables[row]` names (only
the last `window` of them for a sliding-window layer), read in place from the pool's layer views [pages,
page_size, kv_heads, head_dim] (no gather into a padded copy), softmax and weighted sum accumulated in float32
whatever the cache dtype. One program computes one row and one KV head alone (all its query heads, GQA), in a
fixed order, so a row's result does not depend on the others.

The tables are the ones the fence validated; the kernel still never reads outside them or the pool: it
walks at most the table's width, and a page id outside [0, pages) contributes nothing (a row left with no
readable slot comes out NaN, which the runner aborts as non-finite, never as another tenant's data). The
launch makes no host sync, so it can be captured in a CUDA graph.

Triton is imported lazily: the CPU path never needs it. `load()` returns (None, why) where it cannot run:
no triton, or neither a CUDA device nor `TRITON_INTERPRET=1` (the interpreter, for tests on CPU).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@functools.cache
def _kernel() -> Any:
    """The jitted kernel, built on first use (imports triton)."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_decode(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr,
        num_pages, table_width, scale, window,
        q_row, q_head, k_page, k_slot, k_head, t_row, o_row, o_head,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, BLOCK_S)
        heads = kv_head * GROUP + g
        g_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q_off = row * q_row + heads[:, None] * q_head + d[None, :]
        q = tl.load(q_ptr + q_off, mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        length = tl.load(lens_ptr + row)
        # A sliding window starts at `first`; the walk starts at its page, so no earlier page is read.
        first = tl.where((window > 0) & (length > window), length - window, 0)
        # Never past the table, whatever the length says.
        n_pages = tl.minimum((length + PAGE_SIZE - 1) // PAGE_SIZE, table_width)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        denom = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for j in range(first // PAGE_SIZE, n_pages):
            page = tl.load(tables_ptr + row * t_row + j)
            # A page outside the pool holds no readable slot (and is not even addressed).
            limit = tl.where((page >= 0) & (page < num_pages), length, 0)
            page = tl.where(limit > 0, page, 0)
            slot_ok = (j * PAGE_SIZE + s < limit) & (j * PAGE_SIZE + s >= first) & (s < PAGE_SIZE)
            kv_off = page.to(tl.int64) * k_page + s[:, None] * k_slot + kv_head * k_head + d[None, :]
            kv_mask = slot_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
            # [G, S]: a broadcast product, not tl.dot: a GQA group (3 heads for SmolLM2) is below the
            # tensor cores' minimum tile, and decode is bound by reading the pages, not by the FLOPs.
            scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
            scores = tl.where(slot_ok[None, :], scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            # A page with no readable slot leaves m_new at -inf: keep the old state instead of NaN.
            safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - safe_m)
            p = tl.exp(scores - safe_m[:, None])
            denom = denom * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        out = acc / denom[:, None]
        o_off = row * o_row + heads[:, None] * o_head + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])

    return paged_decode


class TritonPagedDecode:
    """Decode attention over the pool in place, on a CUDA device (or the Triton interpreter)."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim]; caches [pages, page_size, kv_heads, head_dim]; block_tables
        [rows, width] int32/int64; context_lens [rows]. Returns [rows, heads, head_dim] in q's dtype."""
        rows, num_heads, head_dim = q.shape
        num_pages, page_size, num_kv_heads, _ = k_cache.shape
        assert q.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
        assert v_cache.shape == k_cache.shape and num_heads % num_kv_heads == 0
        assert block_tables.shape[0] == context_lens.shape[0] == rows and block_tables.stride(1) == 1
        out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype, device=q.device)
        if rows == 0 or block_tables.shape[1] == 0:
            return out.fill_(float("nan")) if rows else out
        group = num_heads // num_kv_heads
        _kernel()[(rows, num_kv_heads)](
            q, k_cache, v_cache, block_tables, context_lens, out,
            num_pages, block_tables.shape[1], scale, window,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
            BLOCK_G=_next_pow2(group), BLOCK_D=_next_pow2(head_dim), BLOCK_S=_next_pow2(page_size),
        )  # fmt: skip
        return out


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (set before triton is first imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def load(device_type: str = "cuda") -> tuple[TritonPagedDecode | None, str]:
    """(the kernel, "") for tensors on `device_type`, or (None, why not)."""
    if device_type != "cuda" and not interpreting():
        return None, f"the Triton kernel runs on CUDA (or under TRITON_INTERPRET=1), not on {device_type}"
    try:
        import triton  # noqa: F401
    except ImportError as error:
        return None, f"triton is not installed ({error})"
    return TritonPagedDecode(), ""
