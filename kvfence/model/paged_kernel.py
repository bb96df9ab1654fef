"""The C paged-attention kernels (csrc/paged_attention.c, csrc/paged_prefill.c), built and loaded by
`native`: decode rows, and prefill chunks whose rows compute alike however a prompt is chunked. Decode is
float32 arithmetic on every build; prefill's two inner products are bf16 (float32 accumulation) on a CPU
with AVX512-BF16 unless `bf16=False` or KVFENCE_PREFILL_F32=1, float32 elsewhere.

`load()` returns None with the reason when the kernels cannot be used: the model then uses its torch
(gather + SDPA) attention, which computes the same thing (prefill rounding with the chunk's shape).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from kvfence.model import native

STATUS = {1: "a block table names a page outside the pool or a length beyond its pages", 2: "out of memory"}

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64]
_ARGTYPES += [ctypes.c_float, _i64, ctypes.c_int]
_PREFILL_ARGTYPES = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _i64]
_PREFILL_ARGTYPES += [ctypes.c_float, _i64, ctypes.c_int]


class PagedAttentionError(RuntimeError):
    """The kernel refused its inputs before reading anything (or could not allocate)."""


class PagedDecodeKernel:
    """A `paged_decode.PagedDecode` in C: decode attention for rows of one query token over their pages,
    in place in the pool; the same result as gathering the pages and running SDPA (float32 arithmetic over a
    float32 or float16 pool, CPU only)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.paged_decode_attention
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int
        self._prefill = library.paged_prefill_attention
        self._prefill.argtypes = _PREFILL_ARGTYPES
        self._prefill.restype = ctypes.c_int
        self._round_half = library.kvf_round_half
        self._round_half.argtypes = [_ptr, _ptr, _i64]
        self._round_half.restype = None

    def round_half(self, values: torch.Tensor) -> torch.Tensor:
        """`values` (float32, CPU) rounded to float16 by the C code that writes K and V into a float16 pool
        (csrc/decoder_layer.c calls it): the same bits as torch's `.half()`, whichever build (tested)."""
        values = values.contiguous()
        assert values.dtype == torch.float32 and values.device.type == "cpu"
        out = torch.empty(values.shape, dtype=torch.float16)
        self._round_half(out.data_ptr(), values.data_ptr(), values.numel())
        return out

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
        [rows, width] int64; context_lens [rows] int64. Returns [rows, heads, head_dim]."""
        rows, num_heads, head_dim = q.shape
        num_pages, page_size, num_kv_heads, _ = k_cache.shape
        _check_pool_inputs(q, k_cache, v_cache, block_tables)
        assert block_tables.dtype == context_lens.dtype == torch.int64
        assert block_tables.is_contiguous() and context_lens.is_contiguous()
        assert block_tables.shape[0] == context_lens.shape[0] == rows and num_heads % num_kv_heads == 0
        out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype)
        if rows == 0:
            return out
        status = self._fn(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            num_pages,
            block_tables.data_ptr(),
            block_tables.shape[1],
            context_lens.data_ptr(),
            out.data_ptr(),
            rows,
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            scale,
            window,
            torch.get_num_threads(),
        )
        if status:
            raise PagedAttentionError(f"paged decode attention: {STATUS.get(status, status)}")
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_table: torch.Tensor,
        start: int,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q [rows, heads, head_dim]: a chunk's queries at positions [start, start + rows), over their context
        in the pages of `block_table` [pages] int64 (the chunk's own K/V written there already). Returns
        [rows, heads, head_dim]; each row depends on its position and the pool's K/V alone."""
        rows, num_heads, head_dim = q.shape
        num_pages, page_size, num_kv_heads, _ = k_cache.shape
        _check_pool_inputs(q, k_cache, v_cache, block_table)
        assert block_table.dtype == torch.int64 and block_table.is_contiguous() and block_table.dim() == 1
        assert num_heads % num_kv_heads == 0 and rows > 0
        out = torch.empty(rows, num_heads, head_dim, dtype=q.dtype)
        status = self._prefill(
            q.data_ptr(),
            q.stride(0),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float16),
            num_pages,
            block_table.data_ptr(),
            block_table.shape[0],
            start,
            rows,
            out.data_ptr(),
            num_heads,
            num_kv_heads,
            head_dim,
            page_size,
            scale,
            window,
            torch.get_num_threads(),
        )
        if status:
            raise PagedAttentionError(f"paged prefill attention: {STATUS.get(status, status)}")
        return out


def _check_pool_inputs(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor
) -> None:
    """What both kernels read: float32 queries, heads of a row contiguous, over one contiguous layer of a
    float32 or float16 pool, everything on the CPU."""
    assert q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype in (torch.float32, torch.float16)
    assert q.device.type == k_cache.device.type == tables.device.type == "cpu"
    assert q.stride(2) == 1 and q.stride(1) == q.shape[2], "heads of a row must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape


# Set to 1, the prefill kernel runs float32 on a CPU with AVX512-BF16 too (the build without it): the
# documented fallback, and the baseline its benchmark compares against.
PREFILL_F32_ENV = "KVFENCE_PREFILL_F32"


def load(
    portable: bool = False, avx512: bool = True, bf16: bool | None = None
) -> tuple[PagedDecodeKernel | None, str]:
    """(the kernel, "") or (None, why not). `portable` builds the plain-C path; `avx512=False` the AVX2 one
    (8-wide float16 conversions) on an AVX-512 machine: each must match the reference (tested). `bf16`:
    the prefill's inner products in bf16 where the CPU has AVX512-BF16 (the default unless
    KVFENCE_PREFILL_F32=1), False: float32 (the decode kernel is float32 in every build)."""
    if bf16 is None:
        bf16 = _bf16_wanted()
    flags = ("-DKVF_PORTABLE",) if portable else () if avx512 else ("-mno-avx512f",)
    return _load(flags if bf16 else (*flags, "-mno-avx512bf16"))


def bf16_prefill() -> bool:
    """Whether `load()`'s prefill kernel runs its inner products in bf16 (this CPU has AVX512-BF16 and
    KVFENCE_PREFILL_F32 is not 1)."""
    return native.has_bf16_dot() and _bf16_wanted()


def _bf16_wanted() -> bool:
    return os.environ.get(PREFILL_F32_ENV) != "1"


@functools.cache
def _load(flags: tuple[str, ...]) -> tuple[PagedDecodeKernel | None, str]:
    library, why = native.load_library("paged_attention", flags, with_sources=("paged_prefill",))
    return (PagedDecodeKernel(library), "") if library is not None else (None, why)
