"""Q4_0 and Q4_1 weights packed for the kernel straight from the file's blocks (csrc/pack_blocks.c).

Contract: `BlockPacker.pack(parts, dot)` returns, for the weights `parts` as the file stores them
(`StoredWeight`), the `PackedWeight` that `PackedWeight.pack` makes of their codes (bit for bit wherever a
weight's codes span all 16 values, as every real weight's do; otherwise the same weights, centred by format
rather than by the least code present), or None for any part it does not take (other formats, or parts of
different formats, or a shape the panels do not fit): the caller then takes the general path. `load()`
returns None where the C packer cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import gguf
import torch

from kvfence.model import native
from kvfence.model.gguf import StoredWeight
from kvfence.model.packed_matmul import DOT_BLOCK, PANEL, PackedWeight

_Q = gguf.GGMLQuantizationType
_WITH_MIN = {_Q.Q4_0: False, _Q.Q4_1: True}  # the formats packed here: whether a block stores its offset
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
_ARGTYPES = [_ptr, _i64, ctypes.c_int, _ptr, _i64, _i64, ctypes.c_int, _ptr, _ptr, _ptr, ctypes.c_int]


class BlockPacker:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.pack_q4
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None

    def pack(self, parts: Sequence[StoredWeight], dot: bool) -> PackedWeight | None:
        """`parts` stacked along output features (a fused projection), laid out for the kernel's int8 dot
        products where `dot`; None where this packer does not take them."""
        kinds = {part.kind for part in parts}
        if len(kinds) != 1 or (kind := kinds.pop()) not in _WITH_MIN:
            return None
        in_features = parts[0].shape[1]
        if in_features % DOT_BLOCK or any(p.shape[1] != in_features or p.shape[0] % PANEL for p in parts):
            return None
        panels, groups = sum(part.shape[0] for part in parts) // PANEL, in_features // DOT_BLOCK
        lines = (panels, in_features // 8, 2, 64) if dot else (panels, in_features, PANEL // 2)
        codes = torch.empty(lines, dtype=torch.uint8)
        scales = torch.empty(panels, groups, PANEL, dtype=torch.float16)
        offsets = torch.empty(panels, groups if _WITH_MIN[kind] else 0, PANEL, dtype=torch.float16)
        first = 0
        for part in parts:
            assert part.blocks.flags.c_contiguous and len(part.rows) == part.shape[0]
            assert part.blocks.shape == (part.shape[0] * groups, gguf.GGML_QUANT_SIZES[kind][1])
            rows = torch.from_numpy(part.rows).to(torch.int64).contiguous()
            self._fn(
                part.blocks.ctypes.data,
                part.blocks.shape[1],
                _WITH_MIN[kind],
                rows.data_ptr(),
                part.shape[0],
                in_features,
                dot,
                codes[first].data_ptr(),
                scales[first].data_ptr(),
                offsets[first].data_ptr() if _WITH_MIN[kind] else None,
                torch.get_num_threads(),
            )
            first += part.shape[0] // PANEL
        return PackedWeight(codes, scales, offsets)


@functools.cache
def load() -> BlockPacker | None:
    """The packer, or None where csrc/pack_blocks.c cannot be built (no C compiler)."""
    library, _ = native.load_library("pack_blocks")
    return BlockPacker(library) if library is not None else None
