"""Q4_0 and Q4_1 weights packed straight from the file's blocks (block_packer, csrc/pack_blocks.c): the
same panels as PackedWeight.pack makes of gguf-py's codes, bit for bit, in both layouts, fused and with
reordered rows; the same weights where a weight's codes leave some of the 16 values unused; and None for
what it does not take, so that the general path packs it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import quantized_blocks

from kvfence.model import block_packer
from kvfence.model.gguf import QuantizedWeight, StoredWeight, read_blocks
from kvfence.model.packed_matmul import PackedWeight

Q = gguf.GGMLQuantizationType
IN = 256


@pytest.fixture(scope="module")
def packer() -> block_packer.BlockPacker:
    packer = block_packer.load()
    assert packer is not None  # CI has a C compiler: a silent fallback would leave the packer untested
    return packer


def stored_and_codes(weight: torch.Tensor, kind: Q, rows: np.ndarray) -> tuple[StoredWeight, QuantizedWeight]:
    """`weight` as a file stores it, output feature n read from stored row rows[n], and the codes the
    loader's general path reads for it (read_blocks, rows reordered likewise)."""
    blocks = quantized_blocks(weight, kind)
    codes, scales, offsets = read_blocks(kind, tuple(weight.shape), blocks)  # type: ignore[misc]
    parts = (torch.from_numpy(part[rows]) for part in (codes, scales, offsets))
    return StoredWeight(kind, (weight.shape[0], weight.shape[1]), blocks, rows), QuantizedWeight(*parts)


def weights(sizes: list[int], kind: Q, seed: int) -> tuple[list[StoredWeight], list[QuantizedWeight]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for size in sizes:
        rows = torch.randperm(size, generator=generator).numpy()
        pairs.append(stored_and_codes(torch.randn(size, IN, generator=generator), kind, rows))
    return [stored for stored, _ in pairs], [codes for _, codes in pairs]


@pytest.mark.parametrize("dot", [False, True], ids=["float-layout", "dot-layout"])
@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1], ids=lambda kind: kind.name)
@pytest.mark.parametrize("sizes", [[64], [128, 32, 32]], ids=["one", "fused"])
def test_the_panels_are_those_of_the_general_path(
    packer: block_packer.BlockPacker, kind: Q, dot: bool, sizes: list[int]
) -> None:
    stored, codes = weights(sizes, kind, seed=len(sizes))
    packed, general = packer.pack(stored, dot), PackedWeight.pack(codes, dot)
    assert packed is not None and general is not None
    for ours, theirs in zip(
        (packed.codes, packed.scales, packed.offsets),
        (general.codes, general.scales, general.offsets),
        strict=True,
    ):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs)
    dequantized = torch.cat([part.dequantize() for part in codes])
    assert torch.equal(packed.rows(torch.arange(sum(sizes))), dequantized)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1], ids=lambda kind: kind.name)
def test_codes_short_of_sixteen_values_still_give_the_same_weights(
    packer: block_packer.BlockPacker, kind: Q
) -> None:
    """Blocks whose codes are all odd (a quantizer always writes code 0 for a block's extreme, so such a
    block is written by hand): the general path then centres the codes on the least one present, the
    packer by format, and the two layouts differ; both give the file's weights."""
    blocks = quantized_blocks(torch.randn(32, IN, generator=torch.Generator().manual_seed(6)), kind)
    codes_at = 4 if kind == Q.Q4_1 else 2
    blocks[:, codes_at:] |= 0x11
    stored = StoredWeight(kind, (32, IN), blocks, np.arange(32))
    codes = QuantizedWeight(*(torch.from_numpy(part) for part in read_blocks(kind, (32, IN), blocks)))  # type: ignore[misc]
    packed, general = packer.pack([stored], dot=True), PackedWeight.pack([codes], dot=True)
    assert packed is not None and general is not None
    assert not torch.equal(packed.codes, general.codes)
    rows = torch.arange(32)
    assert torch.equal(packed.rows(rows), codes.dequantize())
    assert torch.equal(general.rows(rows), codes.dequantize())


def test_what_it_does_not_take_is_left_to_the_general_path(packer: block_packer.BlockPacker) -> None:
    q4_0, _ = weights([32], Q.Q4_0, seed=3)
    q4_1, _ = weights([32], Q.Q4_1, seed=4)
    q8_0, _ = weights([32], Q.Q8_0, seed=5)
    assert packer.pack(q8_0, dot=False) is None  # a format it does not decode
    assert packer.pack(q4_0 + q4_1, dot=False) is None  # a fused projection of two formats
    odd = stored_and_codes(torch.randn(48, IN), Q.Q4_0, np.arange(48))[0]
    assert packer.pack([odd], dot=False) is None  # 48 output features: not whole panels
