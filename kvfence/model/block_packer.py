"""Block-format weights packed for the kernel straight from the file's blocks (csrc/pack_blocks.c).

Contract: `BlockPacker.pack(parts, dot)` returns, for the weights `parts` as the file stores them
(`StoredWeight`, all of one format in `BLOCK_FORMATS`), the `PackedWeight` that `PackedWeight.pack` makes of
the codes gguf-py decodes for them: bit for bit wherever the general path's data-dependent choices fall as
they do for every real weight (4-bit codes spanning 0-15, the other formats' codes more than 16 values);
otherwise the same weights in the format's own storage. None for parts of different formats (Q4_K_M files
fuse Q4_K beside Q6_K) or a shape the panels do not fit: the caller then takes the general path. `load()`
returns None where the C packer cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from kvfence.model import native
from kvfence.model.ggml_types import BLOCK_GEOMETRY, GGMLType
from kvfence.model.gguf import BLOCK_FORMATS, StoredWeight
from kvfence.model.packed_matmul import DOT_BLOCK, PANEL, PackedWeight, narrow_scales

_Q = GGMLType
_NIBBLES = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q4_K})  # codes 0-15, held two a byte
_GROUPS = {_Q.Q6_K: 16}  # weights a scale covers, where not 32
_BYTES, _NIBBLE_ROWS, _DOT_LINES, _BYTE_DOT_LINES = 0, 1, 2, 3  # csrc/pack_blocks.c's layouts
_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_ARGTYPES = [_int, _ptr, _ptr, _i64, _i64, _int, _ptr, _ptr, _ptr, _int]


class BlockPacker:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.pack_blocks
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = ctypes.c_int

    def pack(self, parts: Sequence[StoredWeight], dot: bool) -> PackedWeight | None:
        """`parts` stacked along output features (a fused projection), laid out for the kernel's int8 dot
        products where `dot` and the format allow; None where this packer does not take them."""
        kinds = {part.kind for part in parts}
        if len(kinds) != 1 or (kind := kinds.pop()) not in BLOCK_FORMATS:
            return None
        weights, block_bytes = BLOCK_GEOMETRY[kind]
        in_features = parts[0].shape[1]
        if in_features % weights or any(p.shape[1] != in_features or p.shape[0] % PANEL for p in parts):
            return None
        nibbles, groups = kind in _NIBBLES, in_features // _GROUPS.get(kind, DOT_BLOCK)
        dot = dot and (in_features // groups == DOT_BLOCK or not nibbles)  # byte codes in 16s too (Q6_K)
        layout = (_DOT_LINES if dot else _NIBBLE_ROWS) if nibbles else (_BYTE_DOT_LINES if dot else _BYTES)
        panels = sum(part.shape[0] for part in parts) // PANEL
        shape = {
            _DOT_LINES: (panels, in_features // 8, 2, 64),
            _NIBBLE_ROWS: (panels, in_features, PANEL // 2),
            _BYTE_DOT_LINES: (panels, in_features // 4, 2, 64),
            _BYTES: (panels, in_features, PANEL),
        }[layout]
        codes = torch.empty(shape, dtype=torch.uint8 if nibbles else torch.int8)
        scales, offsets = (torch.empty(panels, groups, PANEL) for _ in range(2))
        first = 0
        for part in parts:
            assert part.blocks.flags.c_contiguous and len(part.rows) == part.shape[0]
            assert part.blocks.shape == (part.shape[0] * in_features // weights, block_bytes)
            rows = torch.from_numpy(part.rows).to(torch.int64).contiguous()
            status = self._fn(
                kind,
                part.blocks.ctypes.data,
                rows.data_ptr(),
                part.shape[0],
                in_features,
                layout,
                codes[first].data_ptr(),
                scales[first].data_ptr(),
                offsets[first].data_ptr(),
                torch.get_num_threads(),
            )
            assert status == 0, f"pack_blocks does not know {kind.name}"  # BLOCK_FORMATS are its formats
            first += part.shape[0] // PANEL
        return PackedWeight(codes, *narrow_scales(scales, offsets))


@functools.cache
def load() -> BlockPacker | None:
    """The packer, or None where csrc/pack_blocks.c cannot be built (no C compiler)."""
    library, _ = native.load_library("pack_blocks")
    return BlockPacker(library) if library is not None else None
