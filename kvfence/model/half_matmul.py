"""Float32 rows times 16-bit weights (bfloat16 or float16, as a Hugging Face directory stores them), with
no float32 copy of the weights: csrc/half_matmul.c.

Contract: `HalfWeight.from_rows` lays [out_features, in_features] rows out in the kernel's panels (the only
copy of the weight, as many bytes plus at most 15 zero rows); `HalfWeight.rows` reads rows back exactly.
`HalfMatmulKernel(x, w)` is `x @ W.T` computed in float32 over the weights' exact float32 values (what a
float32 model over the same weights computes, in another summation order), each output alone in one fixed
order: a row's result does not depend on how many rows share the call. `load()` says why not where it
cannot run.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kvfence.model import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
HALF_DTYPES = (torch.bfloat16, torch.float16)
PANEL = 16  # as csrc/half_matmul.c: output features per panel


@dataclass(frozen=True)
class HalfWeight:
    """panels [ceil(out_features / PANEL), in_features, PANEL] bfloat16 or float16: panel p, line k holds
    W[PANEL * p + j, k] at j, zero past `out_features` (csrc/half_matmul.c's layout)."""

    panels: torch.Tensor
    out_features: int

    @classmethod
    def from_rows(cls, rows: torch.Tensor) -> HalfWeight:
        out_features, in_features = rows.shape
        padded = -out_features % PANEL
        if padded:
            rows = torch.cat([rows, rows.new_zeros(padded, in_features)])
        panels = rows.view(-1, PANEL, in_features).transpose(1, 2).contiguous()
        return cls(panels, out_features)

    @property
    def in_features(self) -> int:
        return self.panels.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.panels.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight rows (output features) `ids`, [len(ids), in_features], in the stored dtype: the
        embedding rows of a tied LM head, read from the panels so that the table is not held twice."""
        return self.panels[ids // PANEL, :, ids % PANEL]


class HalfMatmulKernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fns = {
            split: getattr(library, name)
            for split, name in ((False, "half_matmul"), (True, "half_matmul_threads"))
        }
        for fn in self._fns.values():
            fn.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _i64, ctypes.c_int, _ptr, ctypes.c_int]
            fn.restype = None

    def __call__(self, x: torch.Tensor, weight: HalfWeight, split: bool = False) -> torch.Tensor:
        """x [rows, in_features] float32 (rows may be strided; each row contiguous) -> [rows, out_features]
        float32. The work goes over torch's threads where the product repays waking them, or always with
        `split` (as the C decoder layer calls it: measurements of that path)."""
        rows, in_features = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1
        panels = weight.panels
        assert panels.dtype in HALF_DTYPES and panels.is_contiguous() and weight.in_features == in_features
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        if rows:
            self._fns[split](
                x.data_ptr(),
                x.stride(0),
                rows,
                panels.data_ptr(),
                in_features,
                weight.out_features,
                int(panels.dtype == torch.float16),
                out.data_ptr(),
                torch.get_num_threads(),
            )
        return out


@functools.cache
def load(avx512: bool = True, avx2: bool = True) -> tuple[HalfMatmulKernel | None, str]:
    """(the kernel, "") or (None, why not). `avx512=False` builds the AVX2 path (what an AVX2-only machine
    runs), `avx2=False` too the plain C one: all give the same bits (tested)."""
    flags = (() if avx512 else ("-mno-avx512f",)) + (() if avx2 else ("-mno-avx2",))
    library, why = native.load_library("half_matmul", flags)
    return (HalfMatmulKernel(library), "") if library is not None else (None, why)
