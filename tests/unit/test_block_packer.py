"""Block-format weights packed straight from the file's blocks (block_packer, csrc/pack_blocks.c): for every
format, the same panels as PackedWeight.pack makes of gguf-py's codes, bit for bit, in both layouts, fused
and with reordered rows; the same weights where a 4-bit weight's codes leave some of the 16 values unused;
and None for what it does not take, so that the general path packs it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import quantized_blocks
from hf_reference import K_QUANTS, k_quant_blocks

from kvfence.model import block_packer
from kvfence.model.gguf import BLOCK_FORMATS, QuantizedWeight, StoredWeight, read_blocks
from kvfence.model.packed_matmul import PackedWeight

Q = gguf.GGMLQuantizationType
IN = 256


@pytest.fixture(scope="module")
def packer() -> block_packer.BlockPacker:
    packer = block_packer.load()
    assert packer is not None  # CI has a C compiler: a silent fallback would leave the packer untested
    return packer


def file_blocks(kind: Q, out_features: int, generator: torch.Generator) -> np.ndarray:
    """A random weight [out_features, IN] as a file stores it, [blocks, bytes per block]: quantized by
    gguf-py, or random valid K-quant blocks (gguf-py cannot quantize those)."""
    if kind in K_QUANTS:
        seed = int(torch.randint(1 << 30, (1,), generator=generator))
        blocks = k_quant_blocks(kind, out_features, IN, std=0.1, seed=seed)
        return blocks.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    return quantized_blocks(torch.randn(out_features, IN, generator=generator), kind)


def stored_and_codes(kind: Q, blocks: np.ndarray, rows: np.ndarray) -> tuple[StoredWeight, QuantizedWeight]:
    """A weight stored as `blocks`, output feature n read from stored row rows[n], and the codes the
    loader's general path reads for it (read_blocks, rows reordered likewise)."""
    shape = (len(rows), IN)
    codes, scales, offsets = read_blocks(kind, shape, blocks)  # type: ignore[misc]
    parts = (torch.from_numpy(part[rows]) for part in (codes, scales, offsets))
    return StoredWeight(kind, shape, blocks, rows), QuantizedWeight(*parts)


def weights(sizes: list[int], kind: Q, seed: int) -> tuple[list[StoredWeight], list[QuantizedWeight]]:
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for size in sizes:
        rows = torch.randperm(size, generator=generator).numpy()
        pairs.append(stored_and_codes(kind, file_blocks(kind, size, generator), rows))
    return [stored for stored, _ in pairs], [codes for _, codes in pairs]


@pytest.mark.parametrize("dot", [False, True], ids=["float-layout", "dot-layout"])
@pytest.mark.parametrize("kind", sorted(BLOCK_FORMATS), ids=lambda kind: kind.name)
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
    stored, codes = stored_and_codes(kind, blocks, np.arange(32))
    packed, general = packer.pack([stored], dot=True), PackedWeight.pack([codes], dot=True)
    assert packed is not None and general is not None
    assert not torch.equal(packed.codes, general.codes)
    rows = torch.arange(32)
    assert torch.equal(packed.rows(rows), codes.dequantize())
    assert torch.equal(general.rows(rows), codes.dequantize())


def test_subnormal_and_extreme_float16_scales_read_as_numpy_reads_them(
    packer: block_packer.BlockPacker,
) -> None:
    """The packer converts each block's float16 d itself: zeros, subnormals, the least normal and the
    largest finite value, of both signs, give the general path's scales and weights."""
    halves = np.array([0x0000, 0x8000, 0x0001, 0x8002, 0x0155, 0x03FF, 0x0400, 0x7BFF, 0xFBFF], np.uint16)
    blocks = quantized_blocks(torch.randn(32, IN, generator=torch.Generator().manual_seed(7)), Q.Q8_0)
    blocks[:, :2] = np.resize(halves, len(blocks)).view(np.uint8).reshape(-1, 2)
    stored, codes = stored_and_codes(Q.Q8_0, blocks, np.arange(32))
    packed, general = packer.pack([stored], dot=False), PackedWeight.pack([codes], dot=False)
    assert packed is not None and general is not None
    assert packed.scales.dtype == general.scales.dtype and torch.equal(packed.scales, general.scales)
    assert torch.equal(packed.rows(torch.arange(32)), codes.dequantize())


def test_what_it_does_not_take_is_left_to_the_general_path(packer: block_packer.BlockPacker) -> None:
    q4_k, _ = weights([32], Q.Q4_K, seed=3)
    q6_k, _ = weights([32], Q.Q6_K, seed=4)
    assert packer.pack(q4_k + q6_k, dot=False) is None  # a fused projection of two formats (Q4_K_M's)
    generator = torch.Generator().manual_seed(5)
    odd = stored_and_codes(Q.Q4_0, file_blocks(Q.Q4_0, 48, generator), np.arange(48))[0]
    assert packer.pack([odd], dot=False) is None  # 48 output features: not whole panels
    f16 = StoredWeight(Q.F16, (32, IN), np.zeros((32 * IN, 2), np.uint8), np.arange(32))
    assert packer.pack([f16], dot=False) is None  # not a block format
