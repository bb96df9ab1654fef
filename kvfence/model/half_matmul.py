"""Float32 rows times 16-bit weights (bfloat16 or float16, as a Hugging Face directory stores them), with
no float32 copy of the weights: csrc/half_matmul.c. Or, for bfloat16 weights laid out in pairs, the rows
rounded to bfloat16 times them (bfloat16 products, float32 sums: twice the multiply-adds a cycle on a CPU
with AVX512-BF16).

Contract: `HalfWeight.from_rows` lays [out_features, in_features] rows out in the kernel's panels (the only
copy of the weight, as many bytes plus at most 15 zero rows and, in pairs, one zero column);
`HalfWeight.rows` reads rows back exactly. `HalfMatmulKernel(x, w)` is `x @ W.T` computed in float32 over the
weights' exact float32 values (what a float32 model over the same weights computes, in another summation
order), or with `w.pairs` over x rounded to the nearest bfloat16 (the one rounding: each product is exact
and summed in float32); each output alone in one fixed order: a row's result does not depend on how many
rows share the call. `load()` says why not where it cannot run; `pairs_native()` whether this CPU runs pairs
in vector instructions (elsewhere plain C computes them, slower).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
HALF_DTYPES = (torch.bfloat16, torch.float16)
PANEL = 16  # as csrc/half_matmul.c: output features per panel


@dataclass(frozen=True)
class HalfWeight:
    """panels [ceil(out_features / PANEL), in_features, PANEL] bfloat16 or float16: panel p, line k holds
    W[PANEL * p + j, k] at j, zero past `out_features` (csrc/half_matmul.c's layout). With `pairs` (bfloat16
    only): [ceil(out_features / PANEL), ceil(in_features / 2), PANEL, 2], line q holding W[PANEL * p + j,
    2q + i] at (j, i), zero past `in_features` too (half_matmul_pairs' layout)."""

    panels: torch.Tensor
    out_features: int
    in_features: int
    pairs: bool = False

    @classmethod
    def from_rows(cls, rows: torch.Tensor, pairs: bool = False) -> HalfWeight:
        out_features, in_features = rows.shape
        rows = F.pad(rows, (0, in_features % 2 if pairs else 0, 0, -out_features % PANEL))
        if not pairs:
            panels = rows.view(-1, PANEL, in_features).transpose(1, 2)
        elif rows.dtype == torch.bfloat16:
            panels = rows.view(-1, PANEL, rows.shape[1] // 2, 2).transpose(1, 2)
        else:
            raise ValueError(f"pairs multiply bfloat16 weights, not {rows.dtype}")
        return cls(panels.contiguous(), out_features, in_features, pairs)

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight rows (output features) `ids`, [len(ids), in_features], in the stored dtype: the
        embedding rows of a tied LM head, read from the panels so that the table is not held twice."""
        picked = self.panels[ids // PANEL, :, ids % PANEL]
        return picked.flatten(1)[:, : self.in_features] if self.pairs else picked


class HalfMatmulKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        names = {
            (False, False): "half_matmul",
            (False, True): "half_matmul_threads",
            (True, False): "half_matmul_pairs",
            (True, True): "half_matmul_pairs_threads",
        }
        self._fns = {key: getattr(library, name) for key, name in names.items()}
        for (pairs, _), fn in self._fns.items():
            kind = () if pairs else (ctypes.c_int,)  # pairs take no `half`: their weights are bfloat16
            fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, *kind, _ptr, ctypes.c_int]
            fn.restype = ctypes.c_int if pairs else None

    def __call__(self, x: torch.Tensor, weight: HalfWeight, split: bool = False) -> torch.Tensor:
        """x [rows, in_features] float32 (rows may be strided; each row contiguous) -> [rows, out_features]
        float32. The work goes over torch's threads where the product repays waking them, or always with
        `split` (as the C decoder layer calls it: measurements of that path)."""
        rows, in_features = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        panels = weight.panels
        assert panels.dtype in HALF_DTYPES and panels.is_contiguous() and weight.in_features == in_features
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        if not rows:
            return out
        head = (x.data_ptr(), x.stride(0), rows, panels.data_ptr(), in_features, weight.out_features)
        tail = (out.data_ptr(), torch.get_num_threads())
        if not weight.pairs:
            self._fns[False, split](*head, int(panels.dtype == torch.float16), *tail)
        elif self._fns[True, split](*head, *tail):
            raise MemoryError("half_matmul_pairs: no memory for the rows' bfloat16 copy")
        return out


@functools.cache
def load(avx512: bool = True, avx2: bool = True, bf16: bool = True) -> tuple[HalfMatmulKernel | None, str]:
    """(the kernel, "") or (None, why not). `avx512=False` builds the AVX2 path (what an AVX2-only machine
    runs), `avx2=False` too the plain C one: all give the same bits (tested). `bf16=False` builds pairs'
    plain C path on a CPU with AVX512-BF16 (what other CPUs run)."""
    flags = (() if avx512 else ("-mno-avx512f",)) + (() if avx2 else ("-mno-avx2",))
    library, why = native.load_library("half_matmul", flags + (() if bf16 else ("-mno-avx512bf16",)))
    return (HalfMatmulKernel(library), "") if library is not None else (None, why)


def pairs_native() -> bool:
    """Whether `load()`'s pairs run on vdpbf16ps (this CPU has AVX512-BF16): where they repay the rows'
    rounding."""
    return native.has_bf16_dot()
