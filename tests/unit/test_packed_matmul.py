"""The decode matmul over the GGUF's quantized weights: exact weights, accuracy, batch invariance, the
portable build, and the engine on both paths."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import (
    TINY,
    LogitsRecorder,
    dequantized,
    make_engine,
    quantize,
    quantized_blocks,
    tiny_model,
    tiny_tensors,
)
from hf_reference import K_QUANTS, k_quant_blocks

from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.model import native, packed_matmul
from kvfence.model.gguf import BLOCK_FORMATS, QuantizedWeight, read_blocks
from kvfence.model.packed_matmul import PackedWeight
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

KINDS = (gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)


@pytest.fixture(scope="module")
def kernel() -> packed_matmul.PackedMatmulKernel:
    kernel, why = packed_matmul.load()
    assert kernel is not None, why  # CI has a C compiler: a silent fallback would leave the kernel untested
    return kernel


def quantized_weight(out_features: int, in_features: int, kind: gguf.GGMLQuantizationType, seed: int = 0):
    weight = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
    _, quantized = quantize({"w.proj.weight": weight}, kind)
    return quantized["w.proj.weight"].dequantize(), quantized["w.proj.weight"]


@pytest.mark.parametrize("kind", sorted(BLOCK_FORMATS), ids=lambda kind: kind.name)
def test_codes_times_scales_plus_offsets_are_the_reference_dequantization(
    kind: gguf.GGMLQuantizationType,
) -> None:
    """Bit for bit gguf-py's dequantizer, for every block format the loader keeps as codes (the K-quants
    as random valid blocks: gguf-py cannot quantize them)."""
    if kind in K_QUANTS:
        blocks = k_quant_blocks(kind, 64, 512, std=0.1, seed=1)
    else:
        blocks = quantized_blocks(torch.randn(64, 512, generator=torch.Generator().manual_seed(1)), kind)
    blocks = blocks.reshape(-1, gguf.GGML_QUANT_SIZES[kind][1])
    codes, scales, offsets = read_blocks(kind, (64, 512), blocks)  # type: ignore[misc]
    group = 512 // scales.shape[1]
    assert group == (16 if kind == gguf.GGMLQuantizationType.Q6_K else 32)
    rebuilt = codes.astype(np.float32).reshape(64, -1, group) * scales[..., None] + offsets[..., None]
    assert np.array_equal(rebuilt.reshape(64, 512), gguf.quants.dequantize(blocks, kind).reshape(64, 512))
    weight = QuantizedWeight(*(torch.from_numpy(part) for part in (codes, scales, offsets)))
    assert torch.equal(weight.dequantize(), torch.from_numpy(rebuilt.reshape(64, 512)))


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_kernel_matches_a_float64_matmul(kernel: packed_matmul.PackedMatmulKernel, kind) -> None:
    dense, quantized = quantized_weight(96, 160, kind)
    packed = PackedWeight.pack([quantized])
    assert packed is not None
    x = torch.randn(19, 160, generator=torch.Generator().manual_seed(2))  # tiles of 8, 8, 2 and 1 rows
    reference = x.double() @ dense.double().T
    assert (kernel(x, packed) - reference).abs().max() < 1e-5


@pytest.mark.parametrize(
    ("kind", "dot"),
    [
        (gguf.GGMLQuantizationType.Q4_1, False),
        (gguf.GGMLQuantizationType.Q4_1, True),  # int8 rows, nibbles: tiles of every height up to 8
        (gguf.GGMLQuantizationType.Q8_0, True),  # int8 rows, byte codes
    ],
    ids=["float", "dot nibbles", "dot bytes"],
)
def test_a_row_is_computed_the_same_whatever_the_batch(
    kernel: packed_matmul.PackedMatmulKernel, kind: gguf.GGMLQuantizationType, dot: bool
) -> None:
    _, quantized = quantized_weight(64, 128, kind)
    packed = PackedWeight.pack([quantized], dot=dot)
    assert packed is not None and bool(packed.format & packed_matmul.DOT) == dot
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(3))
    batched = kernel(x, packed)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 11, 16):
        for first in (0, 19 - rows):
            assert torch.equal(kernel(x[first : first + rows], packed), batched[first : first + rows])


@pytest.mark.parametrize("dot", [False, True], ids=["float rows", "int8 rows"])
def test_two_threads_compute_the_bits_one_does(kernel: packed_matmul.PackedMatmulKernel, dot: bool) -> None:
    """A product big enough to be split over threads (16 x 512 x 1024 multiply-adds, over the C threshold):
    each output is one thread's, so the thread count changes no bit (the suite's default is one thread)."""
    _, quantized = quantized_weight(1024, 512, gguf.GGMLQuantizationType.Q4_0)
    packed = PackedWeight.pack([quantized], dot)
    assert packed is not None
    x = torch.randn(16, 512, generator=torch.Generator().manual_seed(6))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernel(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(kernel(x, packed), alone)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_give_the_contiguous_result(kernel: packed_matmul.PackedMatmulKernel) -> None:
    _, quantized = quantized_weight(32, 64, gguf.GGMLQuantizationType.Q8_0)
    packed = PackedWeight.pack([quantized])
    assert packed is not None
    wide = torch.randn(5, 100, generator=torch.Generator().manual_seed(4))
    assert torch.equal(kernel(wide[:, 10:74], packed), kernel(wide[:, 10:74].contiguous(), packed))


@pytest.mark.parametrize(
    ("kind", "dot"),
    [
        (gguf.GGMLQuantizationType.Q4_1, False),  # nibbles, float16 scales and offsets
        (gguf.GGMLQuantizationType.Q8_0, False),  # int8 codes
        (gguf.GGMLQuantizationType.Q4_0, True),  # integer dot products, offsets computed
        (gguf.GGMLQuantizationType.Q4_1, True),
        (gguf.GGMLQuantizationType.Q8_0, True),  # byte codes times int8 rows, offsets left out
        (gguf.GGMLQuantizationType.Q5_1, True),  # byte codes with offsets
    ],
    ids=lambda v: v.name if isinstance(v, gguf.GGMLQuantizationType) else ("dot" if v else "float"),
)
@pytest.mark.parametrize("build", ["portable", "avx2"])
def test_every_build_gives_the_same_bits(
    kernel: packed_matmul.PackedMatmulKernel, kind: gguf.GGMLQuantizationType, dot: bool, build: str
) -> None:
    """This CPU's vector path against plain C, and against the AVX2 path (two vectors of 8 for each of 16)
    that an AVX2-only machine runs: an AVX-512 machine builds it too, so CI checks it whatever its CPU."""
    if build == "avx2" and not {"avx2", "fma", "f16c"} <= native.cpu_flags():
        pytest.skip("this CPU runs no AVX2")
    other, why = packed_matmul.load(portable=build == "portable", avx512=build != "avx2")
    assert other is not None, why
    _, quantized = quantized_weight(64, 96, kind)
    packed = PackedWeight.pack([quantized], dot=dot)
    assert packed is not None and bool(packed.format & packed_matmul.DOT) == dot
    x = torch.randn(13, 96, generator=torch.Generator().manual_seed(5))  # tiles of 8 and 5 rows, or 4s and 1
    assert torch.equal(other(x, packed), kernel(x, packed))
    assert torch.equal(other(x[:5], packed), kernel(x[:5], packed))  # a speculative step's 5 rows: one tile


def test_pack_fuses_parts_and_refuses_what_it_cannot_hold() -> None:
    _, a = quantized_weight(32, 64, gguf.GGMLQuantizationType.Q4_1, seed=6)
    _, b = quantized_weight(64, 64, gguf.GGMLQuantizationType.Q8_0, seed=7)
    fused = PackedWeight.pack([a, b])
    assert fused is not None and (fused.out_features, fused.in_features) == (96, 64)
    assert torch.equal(fused.codes[1, :, 0], b.codes[0])  # panel 1 = output features 32..63 = b's first
    assert PackedWeight.pack([a, None]) is None  # a part BLAS must multiply: the whole fused weight
    odd = QuantizedWeight(a.codes[:16], a.scales[:16], a.offsets[:16])
    assert PackedWeight.pack([odd]) is None  # 16 output features: not a whole panel


def k_quant_weight(kind: gguf.GGMLQuantizationType, out_features: int, seed: int) -> QuantizedWeight:
    blocks = k_quant_blocks(kind, out_features, 256, std=0.1, seed=seed).reshape(
        -1, gguf.GGML_QUANT_SIZES[kind][1]
    )
    return QuantizedWeight(
        *(torch.from_numpy(part) for part in read_blocks(kind, (out_features, 256), blocks))
    )  # type: ignore[misc]


def test_parts_of_different_groups_fuse_into_one_packed_weight(
    kernel: packed_matmul.PackedMatmulKernel,
) -> None:
    """Q4_K (groups of 32) beside Q6_K (groups of 16), as a Q4_K_M file fuses them: the pack shares the
    smaller group, and the kernel matches float64 on the dequantized weights."""
    parts = [
        k_quant_weight(gguf.GGMLQuantizationType.Q4_K, 64, 8),
        k_quant_weight(gguf.GGMLQuantizationType.Q6_K, 32, 9),
    ]
    packed = PackedWeight.pack(parts)
    assert packed is not None and packed.group == 16
    dense = torch.cat([part.dequantize() for part in parts])
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(10))
    assert (kernel(x, packed) - (x.double() @ dense.double().T)).abs().max() < 1e-5


def test_engine_gives_the_same_tokens_on_the_kernel_and_on_blas() -> None:
    models = {name: tiny_model(decode_matmul=name) for name in ("kernel", "dense")}
    assert [m.decode_matmul for m in models.values()] == ["kernel", "dense"]
    prompts = [[(7 * i + j) % 250 + 3 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outputs = {}
    for name, model in models.items():
        # A 16-token budget mixes prefill chunks with decode rows, then pure decode steps follow.
        engine = make_engine(model, max_num_batched_tokens=16)
        outputs[name] = [r.output_token_ids for r in engine.generate(prompts, params)]
    assert outputs["kernel"] == outputs["dense"]
    assert all(len(tokens) == 12 for tokens in outputs["kernel"])


def decode_logits(model: Transformer, with_prefill_alongside: bool) -> list[torch.Tensor]:
    """Request A's logits per step; A is prefilled alone, then decodes alone or while B's prompt is
    prefilled in 8-token chunks in the same steps."""
    engine = make_engine(model, max_num_batched_tokens=9)
    recorder = LogitsRecorder(engine)
    a = engine.add_request(
        [(5 * j) % 250 + 3 for j in range(7)], SamplingParams(max_tokens=8, ignore_eos=True)
    )
    engine.step()  # A's prefill
    if with_prefill_alongside:
        engine.add_request([(3 * j) % 250 + 3 for j in range(40)], SamplingParams(max_tokens=1))
    while engine.has_unfinished():
        engine.step()
    return recorder.steps[a.request_id]


def test_a_decode_row_computes_the_same_in_a_mixed_step() -> None:
    """Decode rows take the kernel in pure decode steps and in steps mixed with prefill chunks alike, so
    a request's decode logits are bit-identical whether or not another request is prefilling."""
    model = tiny_model(decode_matmul="kernel")
    alone, mixed = decode_logits(model, False), decode_logits(model, True)
    assert len(alone) == len(mixed) == 8
    assert all(torch.equal(x, y) for x, y in zip(alone, mixed, strict=True))


def test_choices_and_fallbacks() -> None:
    assert tiny_model().decode_matmul == "dense"  # no quantized weights
    assert "not stored quantized" in tiny_model().decode_matmul_note
    with pytest.raises(ValueError, match="unavailable"):
        Transformer(TINY, tiny_tensors(), decode_matmul="kernel")
    tensors, quantized = quantize(tiny_tensors())
    bf16 = {name: t.to(torch.bfloat16) for name, t in tensors.items()}
    auto = Transformer(TINY, bf16, quantized=quantized)
    assert auto.decode_matmul == "dense" and "float32" in auto.decode_matmul_note
    q_only = {"blk.0.attn_q.weight": quantized["blk.0.attn_q.weight"]}
    tensors = {name: t for name, t in dequantized(tensors, quantized).items() if name not in q_only}
    partial = Transformer(TINY, tensors, quantized=q_only)  # Q without K and V: no fused weight to pack
    assert partial.decode_matmul == "dense" and "no weight fits" in partial.decode_matmul_note
    with pytest.raises(ValueError, match="no weight fits"):
        Transformer(TINY, tensors, quantized=q_only, decode_matmul="kernel")
    with pytest.raises(ValueError, match="decode matmul must be one of"):
        Transformer(TINY, tensors, quantized=quantized, decode_matmul="fast")


def test_the_engine_names_its_decode_paths_at_start() -> None:
    lines: list[str] = []
    LLMEngine(
        EngineConfig(num_pages=64, page_size=4, max_model_len=256),
        tiny_model(decode_matmul="auto"),
        log=lines.append,
    )
    assert "decode attention: kernel" in lines and "decode matmul: kernel" in lines
    lines.clear()
    LLMEngine(EngineConfig(num_pages=64, page_size=4, max_model_len=256), tiny_model(), log=lines.append)
    assert "decode matmul: dense (the weights are not stored quantized)" in lines


ZERO = packed_matmul.ZERO_OFFSETS
STORAGE = {  # the narrowest storage that keeps every weight: nibbles where codes span 16 values, float16
    # where it holds every scale and offset (Q4_0's -8 x d among them), no offsets where all are 0
    gguf.GGMLQuantizationType.Q4_0: packed_matmul.NIBBLES | packed_matmul.HALF,
    gguf.GGMLQuantizationType.Q4_1: packed_matmul.NIBBLES | packed_matmul.HALF,
    gguf.GGMLQuantizationType.Q5_0: packed_matmul.HALF | ZERO,
    gguf.GGMLQuantizationType.Q5_1: packed_matmul.HALF,
    gguf.GGMLQuantizationType.Q8_0: packed_matmul.HALF | ZERO,
    gguf.GGMLQuantizationType.Q4_K: packed_matmul.NIBBLES,
    gguf.GGMLQuantizationType.Q5_K: 0,
    gguf.GGMLQuantizationType.Q6_K: ZERO,
}


def any_weight(kind: gguf.GGMLQuantizationType, out_features: int, seed: int) -> QuantizedWeight:
    if kind in K_QUANTS:
        return k_quant_weight(kind, out_features, seed)
    return quantized_weight(out_features, 256, kind, seed)[1]


@pytest.mark.parametrize("kind", sorted(STORAGE), ids=lambda kind: kind.name)
def test_every_format_packs_to_its_narrowest_storage_and_multiplies_the_same_weights(
    kernel: packed_matmul.PackedMatmulKernel, kind: gguf.GGMLQuantizationType
) -> None:
    weight = any_weight(kind, 64, seed=11)
    packed = PackedWeight.pack([weight])
    assert packed is not None and packed.format == STORAGE[kind]
    dense = weight.dequantize()
    x = torch.randn(13, 256, generator=torch.Generator().manual_seed(12))
    assert (kernel(x, packed) - (x.double() @ dense.double().T)).abs().max() < 1e-5
    portable, why = packed_matmul.load(portable=True)
    assert portable is not None, why
    batched = kernel(x, packed)
    assert torch.equal(portable(x, packed), batched)
    # Alone (and two at a time) a row takes the per-tile kernel, among 13 the strip: the same bits.
    assert all(torch.equal(kernel(x[i : i + 1], packed), batched[i : i + 1]) for i in range(13))
    assert torch.equal(kernel(x[3:5], packed), batched[3:5])
    ids = torch.tensor([0, 5, 16, 17, 31, 32, 63])  # both nibbles of a byte, and the second panel
    assert torch.equal(packed.rows(ids), dense[ids])
    bytes_per_weight = packed.bytes / dense.numel()
    # Q8_0 and Q5_0 (float16 scales) 1.0625 bytes a weight, Q6_K (float32 scales per 16) 1.25: no offsets
    expected = {3: 0.625, 2: 1.125, 1: 0.75, 0: 1.25, 2 | ZERO: 1.0625, ZERO: 1.25}
    # Q4_0's offsets are -8 x its scales: computed, not stored, 0.5625 bytes a weight as in the file
    centered = kind == gguf.GGMLQuantizationType.Q4_0
    assert packed.centered == centered and packed.symmetric == bool(packed.format & ZERO)
    assert bytes_per_weight == (0.5625 if centered else expected[packed.format])


@pytest.mark.parametrize("dot", [False, True], ids=["float", "int8"])
def test_offsets_left_out_where_all_are_zero_give_the_same_bits(
    kernel: packed_matmul.PackedMatmulKernel, dot: bool
) -> None:
    """Signed codes (Q8_0, Q6_K) have every offset 0: not stored, and the products are those of the zeros
    stored, bit for bit, one row (tiles) or many (strips)."""
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q6_K):
        packed = PackedWeight.pack([any_weight(kind, 64, seed=3)], dot=dot)
        assert packed is not None and packed.symmetric and packed.offsets.numel() == 0
        stored = PackedWeight(packed.codes, packed.scales, torch.zeros_like(packed.scales))
        assert not stored.format & ZERO
        for rows in (1, 13):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            assert torch.equal(kernel(x, packed), kernel(x, stored))
