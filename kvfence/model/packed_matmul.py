"""The decode-row matmul over the GGUF's own quantized weights (csrc/packed_matmul.c), built by `native`.

`PackedWeight.pack` lays a weight's codes out in panels of output columns once, at load (block_packer.py
lays them out the same way straight from the file's blocks), in the narrowest storage that still
gives the same float32 weights (see `QuantizedWeight` and the kernel's contract): codes spanning at most
16 values as nibbles, scales and offsets float16 holds exactly as float16. The kernel then computes
`x @ W.T` for any number of rows reading 0.625 bytes a weight for Q4_0/Q4_1 (as in the file), 0.75 for
Q4_K, 1.125 for Q8_0, 1.25 to 1.5 otherwise, instead of BLAS's 4.
The packed codes are the only copy of a quantized weight (`PackedWeight.rows` reads embedding rows from
them). `load()` returns None with the reason when the kernel cannot be used.
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
_ARGTYPES = [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_int]
NIBBLES, HALF, DOT, ZERO_OFFSETS = 1, 2, 4, 16  # csrc/packed_matmul.c's format bits
DOT_BLOCK = 32  # as csrc/packed_matmul.c: the int8 activations' block (and the dot layout's group)
_BAD_GROUP = 3  # csrc/packed_matmul.c's KVF_BAD_GROUP


@dataclass(frozen=True)
class PackedWeight:
    """codes [panels, in_features, PANEL] int8 (or uint8 nibbles, [panels, in_features, PANEL // 2], or
    laid out for integer dot products: nibbles [panels, in_features // 8, 2, 64], int8 [panels,
    in_features // 4, 2, 64]) and scales / offsets
    [panels, in_features // group, PANEL] float32 (or float16): panel p holds output features
    [p * PANEL, (p + 1) * PANEL), k-major, as the kernel reads them. `offsets` empty ([panels, 0, PANEL])
    where the kernel knows them: every one 0 where `symmetric` (signed codes: Q8_0, Q5_0, Q6_K), else -8 x
    its scale (Q4_0: `centered`)."""

    codes: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    symmetric: bool = False

    @property
    def format(self) -> int:
        """The kernel's storage bits: NIBBLES, HALF, DOT, ZERO_OFFSETS."""
        return (
            (NIBBLES if self.codes.dtype == torch.uint8 else 0)
            | (HALF if self.scales.dtype == torch.float16 else 0)
            | (DOT if self.codes.dim() == 4 else 0)
            | (ZERO_OFFSETS if self.symmetric else 0)
        )

    @property
    def centered(self) -> bool:
        """The offsets are not stored: each is -8 x its scale."""
        return self.offsets.shape[1] == 0 and not self.symmetric

    def offsets_address(self) -> int | None:
        """The offsets as the kernel takes them: None (a NULL pointer) where it knows them."""
        return None if self.offsets.shape[1] == 0 else self.offsets.data_ptr()

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets))

    @property
    def in_features(self) -> int:
        if self.format & DOT:  # a line holds 8 k of nibbles, 4 of bytes
            return self.codes.shape[1] * (8 if self.format & NIBBLES else 4)
        return self.codes.shape[1]

    @property
    def out_features(self) -> int:
        return self.codes.shape[0] * PANEL

    @property
    def group(self) -> int:
        return self.in_features // self.scales.shape[1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 weight rows (output features) `ids`, [len(ids), in_features]: embedding rows of a
        tied LM head, read from the panels so that the embedding is not held twice."""
        panel, column = ids // PANEL, ids % PANEL
        if self.format & DOT and self.format & NIBBLES:  # byte 4j + i of line (t, half): k = 8t + i low,
            lines = self.codes.view(-1, self.in_features // 8, 2, 16, 4)  # k = 8t + 4 + i high
            raw = lines[panel, :, column // 16 % 2, column % 16]
            codes = torch.stack([raw & 15, raw >> 4], dim=2).reshape(len(ids), self.in_features).float()
        elif self.format & DOT:  # byte 4j + i of line (t, half): k = 4t + i
            lines = self.codes.view(-1, self.in_features // 4, 2, 16, 4)
            codes = lines[panel, :, column // 16 % 2, column % 16].reshape(len(ids), self.in_features).float()
        elif self.format & NIBBLES:  # column j < 16 in byte j's low nibble, column j + 16 in its high one
            raw = self.codes[panel, :, column % (PANEL // 2)]
            codes = torch.where((column < PANEL // 2)[:, None], raw & 15, raw >> 4).float()
        else:
            codes = self.codes[panel, :, column].float()  # [n, in_features]
        n = len(ids)
        scales = self.scales[panel, :, column].float()
        if self.offsets.shape[1]:
            offsets = self.offsets[panel, :, column].float()
        else:
            offsets = -8 * scales if self.centered else torch.zeros_like(scales)
        blocks = codes.view(n, -1, self.group) * scales[..., None] + offsets[..., None]
        return blocks.view(n, self.in_features)

    @classmethod
    def pack(cls, parts: Sequence[QuantizedWeight | None], dot: bool = False) -> PackedWeight | None:
        """The weights of `parts` stacked along output features (a fused projection), or None when one is
        not quantized or the shape does not fit the panels. Parts with different groups (Q4_K's 32 beside
        Q6_K's 16, as Q4_K_M files mix them) share the smallest: a scale repeated is the same weight.
        `dot`: laid out for the kernel's integer dot products over int8 activations: nibbles in groups of
        32, byte codes in groups of 32 or 16 (Q6_K's: two groups to each block of 32 activations)."""
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
        codes, offsets = _as_nibbles(codes, scales, offsets)
        scales, offsets, symmetric = narrow_scales(scales, offsets)

        def panels(t: torch.Tensor) -> torch.Tensor:
            return t.view(out_features // PANEL, PANEL, t.shape[1]).transpose(1, 2).contiguous()

        bytes_in_16s = group == DOT_BLOCK // 2 and codes.dtype == torch.int8 and in_features % DOT_BLOCK == 0
        if dot and (group == DOT_BLOCK or bytes_in_16s):
            lines = _dot_layout(codes) if codes.dtype == torch.uint8 else _byte_dot_layout(codes)
            return cls(lines, panels(scales), panels(offsets), symmetric)
        if codes.dtype == torch.uint8:  # bytes of (column j, column j + 16) nibble pairs, per panel
            by_panel = panels(codes).view(out_features // PANEL, in_features, 2, PANEL // 2)
            codes_panels = (by_panel[:, :, 0] | (by_panel[:, :, 1] << 4)).contiguous()
        else:
            codes_panels = panels(codes)
        return cls(codes_panels, panels(scales), panels(offsets), symmetric)


def _dot_layout(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] nibble codes as the kernel's dot products read them, [panels, in // 8, 2, 64]: per 8 of k
    (t) and half panel of 16 columns j, byte 4j + i holds k = 8t + i low and k = 8t + 4 + i high."""
    out_features, in_features = codes.shape
    split = codes.view(out_features // PANEL, 2, 16, in_features // 8, 2, 4)  # [P, half, j, t, high, i]
    lines = split.permute(0, 3, 1, 2, 5, 4)  # [P, t, half, j, i, high]
    # Written in place, in the layout's own order: no temporary, no copy to make the result contiguous.
    out = torch.empty(lines.shape[:-1], dtype=torch.uint8)
    torch.bitwise_left_shift(lines[..., 1], 4, out=out)
    out |= lines[..., 0]
    return out.view(out_features // PANEL, in_features // 8, 2, 64)


def _byte_dot_layout(codes: torch.Tensor) -> torch.Tensor:
    """[out, in] int8 codes as the kernel's dot products read them, [panels, in // 4, 2, 64]: per 4 of k (t)
    and half panel of 16 columns j, byte 4j + i holds k = 4t + i."""
    out_features, in_features = codes.shape
    split = codes.view(out_features // PANEL, 2, 16, in_features // 4, 4)  # [P, half, j, t, i]
    lines = split.permute(0, 3, 1, 2, 4).contiguous()  # [P, t, half, j, i]
    return lines.view(out_features // PANEL, in_features // 4, 2, 64)


def _as_nibbles(
    codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, offsets) as 4-bit codes where every code fits 16 values from the least, `low`: code - low,
    with offset + low * scale, used only where that offset is exact in float32 (Q4_0's -8 * d is; a
    K-quant's low is 0), so that every weight stays the same float32 value. Else unchanged, int8."""
    low, high = (int(bound) for bound in torch.aminmax(codes))
    if high - low > 15:
        return codes, offsets
    shifted = offsets.double() + low * scales.double()
    if not torch.equal(shifted.float().double(), shifted):
        return codes, offsets
    return (codes - low).view(torch.uint8), shifted.float()  # int8 cannot overflow: each is 0 to 15


def narrow_scales(scales: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Scales and offsets (groups along dim 1) in the narrowest storage the kernel reads them from: both
    float16 where it holds every value of both exactly (a non-K format's), else both float32; offsets
    not stored (size 0 along groups) where each is -8 x its scale (Q4_0) or each is 0 (signed codes,
    then `symmetric`, the third value): the kernel knows them."""
    half = scales.half(), offsets.half()
    if all(torch.equal(h.float(), f.float()) for h, f in zip(half, (scales, offsets), strict=True)):
        scales, offsets = half
    else:
        scales, offsets = scales.float(), offsets.float()
    symmetric = not bool(offsets.any())
    if symmetric or torch.equal(offsets.float(), -8 * scales.float()):  # exactly: -8 x a float is exact
        offsets = offsets.new_empty(offsets[:, :0].shape)  # no view: the storage goes
    return scales, offsets, symmetric


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
            weight.offsets_address(),
            in_features,
            weight.group,
            weight.codes.shape[0],
            weight.format,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status == _BAD_GROUP:
            raise ValueError(f"packed matmul: no dot products over {weight.group}-weight groups of these")
        if status:
            raise MemoryError("packed matmul: out of memory")
        return out


@functools.cache
def load(
    portable: bool = False, vnni: bool = True, avx512: bool = True
) -> tuple[PackedMatmulKernel | None, str]:
    """(the kernel, "") or (None, why not). `portable` builds the plain-C path, without the CPU's vector
    intrinsics; `vnni=False` the AVX-512 dot products without VNNI; `avx512=False` the AVX2 path (an
    AVX-512 machine then runs what an AVX2-only one does): all must give the same bits (tested)."""
    flags = ("-DKVF_PORTABLE",) if portable else () if vnni else ("-mno-avx512vnni",)
    flags += () if avx512 else ("-mno-avx512f",)
    library, why = native.load_library("packed_matmul", flags)
    return (PackedMatmulKernel(library), "") if library is not None else (None, why)
