"""The packed kernel's int8 activations (`--activation-dtype int8`, csrc/packed_matmul.c's KVF_DOT): what it
computes exactly, that it is the same on every build and batch shape, and that the engine keeps its pins."""

from __future__ import annotations

import gguf
import pytest
import torch
from conftest import make_engine, tiny_model
from test_packed_matmul import decode_logits, k_quant_weight, quantized_weight

from kvfence.model import native, packed_matmul
from kvfence.model.gguf import QuantizedWeight
from kvfence.model.packed_matmul import DOT, DOT_BLOCK, PackedWeight
from kvfence.sampling import SamplingParams

Q4_0, Q4_1, Q4_K = (gguf.GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q4_K"))
Q8_0, Q5_0, Q5_1, Q5_K = (gguf.GGMLQuantizationType[name] for name in ("Q8_0", "Q5_0", "Q5_1", "Q5_K"))
Q6_K = gguf.GGMLQuantizationType.Q6_K
DOT_KINDS = (Q4_0, Q4_1, Q4_K, Q8_0, Q5_0, Q5_1, Q5_K, Q6_K)  # every format: nibbles or bytes, 32s or 16s


@pytest.fixture(scope="module")
def kernel() -> packed_matmul.PackedMatmulKernel:
    kernel, why = packed_matmul.load()
    assert kernel is not None, why
    return kernel


def weight(kind: gguf.GGMLQuantizationType, out_features: int = 96) -> QuantizedWeight:
    if kind in (Q4_K, Q5_K, Q6_K):
        return k_quant_weight(kind, out_features, seed=11)
    return quantized_weight(out_features, 256, kind, seed=12)[1]


def rounded_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel multiplies it: per block of 32, q = round(x * (127 / max|x|)) (half to even), times
    max|x| / 127, each step in float32 as C computes it."""
    blocks = x.view(x.shape[0], -1, DOT_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return ((blocks * inverse).round() * (amax / 127)).view_as(x)


FUSED_K_M = "Q4_K+Q6_K"  # a Q4_K_M file's projection: Q4_K's groups of 32 (with offsets) as 16s beside Q6_K's


def parts_of(kind: gguf.GGMLQuantizationType | str, out_features: int = 96) -> list[QuantizedWeight]:
    if kind == FUSED_K_M:
        return [weight(Q4_K, out_features // 2), k_quant_weight(Q6_K, out_features // 2, seed=5)]
    return [weight(kind, out_features)]  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [*DOT_KINDS, FUSED_K_M], ids=lambda kind: getattr(kind, "name", kind))
def test_int8_rows_times_the_exact_weights(kernel: packed_matmul.PackedMatmulKernel, kind) -> None:
    """The result is the float64 product of the rounded rows and the exact weights (to float32's own
    rounding of the epilogue), and so differs from the float path by the rows' rounding. Groups of 16 take
    two sums per block of 32 activations, each with its own scale and offset."""
    parts = parts_of(kind)
    packed, exact = PackedWeight.pack(parts, dot=True), PackedWeight.pack(parts)
    assert packed is not None and exact is not None and packed.format & DOT and not exact.format & DOT
    assert packed.group == (16 if kind in (Q6_K, FUSED_K_M) else 32)
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(13))  # tiles of 8, 8, 2 and 1 rows
    dense = torch.cat([part.dequantize() for part in parts]).double()
    reference = rounded_rows(x).double() @ dense.T
    got = kernel(x, packed)
    assert (got - reference).abs().max() < 1e-4 * reference.abs().max()
    assert (got - (x.double() @ dense.T)).abs().max() > 1e-3 * reference.abs().max()  # it did round


def test_every_build_and_batch_shape_gives_the_same_bits(kernel: packed_matmul.PackedMatmulKernel) -> None:
    """Integer sums are exact on every path (VNNI, AVX-512BW without it, plain C) and the float epilogue is
    the same operations: the bits agree; a row's result does not depend on the rows beside it. Nibble
    codes (Q4_1) and byte codes (Q8_0, Q5_K's float32 scales, Q6_K's groups of 16, fused) alike."""
    x = torch.randn(19, 256, generator=torch.Generator().manual_seed(14))
    for kind in (Q4_1, Q8_0, Q5_K, Q6_K, FUSED_K_M):
        packed = PackedWeight.pack(parts_of(kind, 64), dot=True)
        assert packed is not None and packed.format & DOT
        batched = kernel(x, packed)
        for build in ({"portable": True}, {"vnni": False}, {"avx512": False}):
            other, why = packed_matmul.load(**build)
            assert other is not None, why
            assert torch.equal(other(x, packed), batched), (kind, build)
        for rows in (1, 2, 3, 5, 8, 11, 16):
            for first in (0, 19 - rows):
                assert torch.equal(kernel(x[first : first + rows], packed), batched[first : first + rows])


@pytest.mark.parametrize("build", [{}, {"avx512": False}], ids=["this CPU", "avx2"])
def test_the_largest_block_sums_are_exact(build: dict[str, bool]) -> None:
    """Codes of 15 against activations of +-127 all through a block: the largest integer sums any path
    accumulates (AVX2's int16 lanes reach 8 x 2 x 15 x 127 = 30480 of 32767): each path computes what plain
    C does and what float64 does."""
    if build and not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU runs no AVX2")
    kernel, why = packed_matmul.load(**build)
    portable, why_not = packed_matmul.load(portable=True)
    assert kernel is not None and portable is not None, why or why_not
    codes = torch.full((64, 256), 15, dtype=torch.int8)
    codes[7] = 0  # the least code 0: nibbles keep the codes as they are (15 is the largest a nibble holds)
    quantized = QuantizedWeight(codes, torch.ones(64, 8), torch.zeros(64, 8))
    packed = PackedWeight.pack([quantized], dot=True)
    assert packed is not None and packed.format & DOT
    x = torch.stack(
        [torch.ones(256), -torch.ones(256), torch.ones(256).index_fill(0, torch.arange(0, 256, 2), -1)]
    )
    got = kernel(x, packed)
    assert torch.equal(got, portable(x, packed))
    reference = x.double() @ quantized.dequantize().double().T
    assert torch.allclose(got.double(), reference, rtol=1e-6, atol=1e-6)
    assert got[0, 0] == 15 * 256 and got[1, 0] == -15 * 256 and got[0, 7] == 0


@pytest.mark.parametrize("build", [{}, {"avx512": False}], ids=["this CPU", "avx2"])
def test_the_largest_byte_code_sums_are_exact(build: dict[str, bool]) -> None:
    """Byte codes of -128 and 127 against activations of +-127 all through a block: each unsigned x signed
    pair (|c| x q with c's sign) reaches 2 x 128 x 127 = 32512 of 32767; each path computes what plain C
    does and what float64 does."""
    if build and not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU runs no AVX2")
    kernel, why = packed_matmul.load(**build)
    portable, why_not = packed_matmul.load(portable=True)
    assert kernel is not None and portable is not None, why or why_not
    codes = torch.full((64, 256), -128, dtype=torch.int8)
    codes[1::2] = 127
    quantized = QuantizedWeight(codes, torch.ones(64, 8), torch.zeros(64, 8))
    packed = PackedWeight.pack([quantized], dot=True)
    assert packed is not None and packed.format & DOT and not packed.format & packed_matmul.NIBBLES
    x = torch.stack(
        [torch.ones(256), -torch.ones(256), torch.ones(256).index_fill(0, torch.arange(0, 256, 2), -1)]
    )
    got = kernel(x, packed)
    assert torch.equal(got, portable(x, packed))
    assert torch.equal(got.double(), x.double() @ quantized.dequantize().double().T)
    assert got[0, 0] == -128 * 256 and got[1, 0] == 128 * 256 and got[0, 1] == 127 * 256 and got[2, 0] == 0


def test_the_dot_layout_keeps_the_weights() -> None:
    """Embedding rows read from the dot layout (a tied LM head), nibbles or bytes, groups of 32 or 16, are
    the float layout's and the file's."""
    ids = torch.tensor([0, 5, 15, 16, 31, 32, 63, 95])
    for kind in (Q4_0, Q8_0, Q5_1, Q6_K, FUSED_K_M):
        parts = parts_of(kind)
        dot, exact = PackedWeight.pack(parts, dot=True), PackedWeight.pack(parts)
        assert dot is not None and exact is not None and dot.format & DOT
        assert torch.equal(dot.rows(ids), exact.rows(ids))
        assert torch.equal(dot.rows(ids), torch.cat([part.dequantize() for part in parts])[ids])


def test_dot_products_refuse_groups_they_do_not_sum(kernel: packed_matmul.PackedMatmulKernel) -> None:
    """Nibbles in groups of 16 (no format has them) would be summed over 32: refused, not miscomputed."""
    packed = PackedWeight.pack([weight(Q4_1, 32)], dot=True)
    assert packed is not None and packed.format & packed_matmul.NIBBLES
    scales, offsets = (t.repeat_interleave(2, dim=1) for t in (packed.scales, packed.offsets))
    halved = PackedWeight(packed.codes, scales, offsets)
    assert halved.group == 16
    with pytest.raises(ValueError, match="over 16-weight groups"):
        kernel(torch.randn(1, 256), halved)


def test_the_engine_on_int8_activations_keeps_decode_rows_alone() -> None:
    """The batch-invariance pin holds: a decode row's logits are the same bits whether or not a prefill
    shares its steps; requests complete, and the tokens are the model's own (not the float path's)."""
    model = tiny_model(decode_matmul="kernel", activation_dtype="int8")
    assert model.activation_dtype == "int8" and model.lm_head.packed is not None
    assert model.lm_head.packed.format & DOT
    alone, mixed = decode_logits(model, False), decode_logits(model, True)
    assert len(alone) == len(mixed) == 8
    assert all(torch.equal(x, y) for x, y in zip(alone, mixed, strict=True))
    exact = decode_logits(tiny_model(decode_matmul="kernel"), False)
    assert not all(torch.equal(x, y) for x, y in zip(alone, exact, strict=True))
    engine = make_engine(model)
    finished = engine.generate([[3, 4, 5, 6], [7, 8, 9]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(r.output_token_ids) for r in finished] == [6, 6]
    with pytest.raises(ValueError, match="activation dtype must be one of"):
        tiny_model(decode_matmul="kernel", activation_dtype="int4")
