"""The decode-row matmul over the GGUF's own quantized weights (csrc/packed_matmul.c), built by `native`.

`PackedWeight.pack` lays a weight's codes out in panels of output columns once, at load; the kernel
then computes `x @ W.T` for any number of rows reading 1.25 bytes per weight (1.5 with Q6_K's groups of
16) instead of BLAS's 4, with the same float32 weights (see `QuantizedWeight`). The packed codes are the
only copy of a quantized weight (`PackedWeight.rows` reads embedding rows from them). `load()` returns
None with the reason when the kernel cannot be used.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvfence.model import native
from kvfence.model.gguf import QuantizedWeight

PANEL = 32  # as csrc/packed_matmul.c: output columns per panel

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, ctypes.c_int]


@dataclass(frozen=True)
class PackedWeight:
    """codes [panels, in_features, PANEL] int8 and scales / offsets [panels, in_features // group, PANEL]:
    panel p holds output features [p * PANEL, (p + 1) * PANEL), k-major, as the kernel reads them."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * PANEL

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows (output features) `ids`, [len(ids), in_features]: embedding rows of a
        tied LM head, read from the panels so that the embedding is not held twice."""
        panel, column = ids // PANEL, ids % PANEL
        codes = self.codes[panel, :, column].float()  # [n, in_features]
        n = len(ids)
        scales, offsets = self.scales[panel, :, column], self.offsets[panel, :, column]
        blocks = codes.view(n, -1, self.group) * scales[..., None] + offsets[..., None]
        return blocks.view(n, self.in_features)

    @classmethod
    def pack(cls, parts: Sequence[QuantizedWeight | None]) -> PackedWeight | None:
        """The weights of `parts` stacked along output features (a fused projection), or None when one is
        not quantized or the shape does not fit the panels. Parts with different groups (Q4_K's 32 beside
        Q6_K's 16, as Q4_K_M files mix them) share the smallest: a scale repeated is the same weight."""
        present = [part for part in parts if part is not None]
        if len(present) < len(parts):
            return None
        group = min(part.group for part in present)

        def regrouped(t: torch.Tensor, part: QuantizedWeight) -> torch.Tensor:
            return t.repeat_interleave(part.group // group, dim=1)

        codes = torch.cat([part.codes for part in present])
        scales = torch.cat([regrouped(part.scales, part) for part in present])
        offsets = torch.cat([regrouped(part.offsets, part) for part in present])
        out_features, in_features = codes.shape
        if out_features % PANEL or in_features % group:
            return None

        def panels(t: torch.Tensor) -> torch.Tensor:
            return t.view(out_features // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()

        return cls(panels(codes), panels(scales.float()), panels(offsets.float()))


class PackedMatmulKernel:
    """`__call__(x, weight)` is `x @ W.T` in float32 for CPU tensors; each row's result is the same
    whatever the number of rows (so decode rows compute alike alone and batched)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.packed_matmul
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
        """x [rows, in_features] float32 (rows may be strided; each row contiguous) -> [rows, out]."""
        rows, in_features = x.shape
        assert x.dtype == torch.float32 and x.device.type == "cpu" and in_features == weight.in_features
        assert x.stride(1) == 1 or in_features == 1, "each row must be contiguous"
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        if rows == 0:
            return out
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            rows,
            weight.codes.data_ptr(),
            weight.scales.data_ptr(),
            weight.offsets.data_ptr(),
            in_features,
            weight.group,
            weight.codes.shape[0],
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status:
            raise MemoryError("packed matmul: out of memory")
        return out


@functools.cache
def load(portable: bool = False) -> tuple[PackedMatmulKernel | None, str]:
    """(the kernel, "") or (None, why not). `portable` builds the plain-C path, without the CPU's vector
    intrinsics, which must give the same bits (tested)."""
    library, why = native.load_library("packed_matmul", ("-DKVF_PORTABLE",) if portable else ())
    return (PackedMatmulKernel(library), "") if library is not None else (None, why)
