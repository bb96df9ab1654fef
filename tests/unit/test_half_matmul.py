"""The 16-bit kernel (csrc/half_matmul.c) and its panels: rows read back exactly; products within float32
rounding of float64's; each row bit for bit the same alone or among any number of rows, on one thread or
two, split or not, AVX-512, AVX2 or plain C; and a tiny random HF directory whose prompt is prefilled in one
chunk of several row blocks through it, against transformers in float32 within the golden tolerance. Pairs
(bfloat16 rows times bfloat16 weights): the same, over float64's products of the rows rounded to bfloat16,
and vdpbf16ps bit for bit what its definition's order computes in plain C.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import LogitsRecorder, assert_same_greedy, make_engine
from test_archs import SHAPE, hf_greedy, hf_model
from test_hf_dir import write_dir

from kvfence.model import half_matmul, native
from kvfence.model.half_matmul import PANEL, HalfWeight
from kvfence.model.hf_load import load_hf_dir
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
DTYPES = [torch.bfloat16, torch.float16]
# Output features past whole panels and panel groups, input features of no particular multiple; row counts
# around the kernel's tile (6) and threaded block (24) of rows.
SHAPES = [(130, 100), (64, 576), (7, 33)]
ROW_COUNTS = [1, 2, 5, 6, 7, 23, 24, 25, 61]


def kernel(avx512: bool = True, avx2: bool = True) -> half_matmul.HalfMatmulKernel:
    built, why = half_matmul.load(avx512, avx2)
    if built is None:
        pytest.skip(why)
    return built


def on_one_then_two_threads(run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        torch.set_num_threads(2)
        return one, run()
    finally:
        torch.set_num_threads(previous)


def weights(out_features: int, in_features: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(out_features, in_features, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_panels_hold_the_rows(dtype: torch.dtype) -> None:
    rows = weights(37, 20, dtype)
    panels = HalfWeight.from_rows(rows)
    assert panels.panels.shape == (3, 20, PANEL) and panels.out_features == 37 and panels.in_features == 20
    assert torch.equal(panels.rows(torch.tensor([36, 0, 17, 16])), rows[[36, 0, 17, 16]])
    assert not panels.panels[2, :, 5:].any()  # past out_features: zeros


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_each_row_alone_in_any_batch(dtype: torch.dtype, out_features: int, in_features: int) -> None:
    w = weights(out_features, in_features, dtype)
    panels = HalfWeight.from_rows(w)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(1))
    full = kernel()(x, panels)
    exact = x.double() @ w.double().T
    assert (full.double() - exact).abs().max() <= 1e-5 * in_features**0.5 * max(1.0, float(exact.abs().max()))
    for count in ROW_COUNTS:  # the first `count` rows alone give what they gave among all
        assert torch.equal(kernel()(x[:count], panels), full[:count]), count
        assert torch.equal(kernel()(x[:count], panels, split=True), full[:count]), count
    strided = torch.randn(5, in_features + 3)[:, :in_features]
    assert torch.equal(kernel()(strided, panels), kernel()(strided.contiguous(), panels))


@pytest.mark.parametrize("dtype", DTYPES)
def test_threads_and_instruction_sets_give_the_same_bits(dtype: torch.dtype) -> None:
    if not {"avx512f", "avx2"} <= native.cpu_flags():
        pytest.skip("no AVX-512 here: not every path can run")
    panels = HalfWeight.from_rows(weights(300, 576, dtype))
    x = torch.randn(30, 576, generator=torch.Generator().manual_seed(2))
    one, two = on_one_then_two_threads(lambda: kernel()(x, panels, split=True))
    assert torch.equal(one, two)
    assert torch.equal(kernel(avx512=False)(x, panels), one)
    assert torch.equal(kernel(avx512=False, avx2=False)(x, panels), one)


def test_a_prefill_of_many_row_blocks_matches_transformers(tmp_path: Path) -> None:
    """One 60-token prompt prefilled in one chunk (row blocks of 24, tiles of 6 and a tail) and decoded
    through the 16-bit kernel over float32 rows: transformers' float32 greedy tokens and logits, golden
    tolerance."""
    directory = write_dir(tmp_path / "llama", hf_model("llama"))
    model = Transformer.from_gguf(load_hf_dir(directory), activation_dtype="float32")
    assert model.half_matmul is not None and model.lm_head.half is not None
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    engine = make_engine(model, max_num_batched_tokens=128, max_model_len=128)
    recorder = LogitsRecorder(engine)
    prompt = torch.randint(0, SHAPE["vocab_size"], (60,), generator=torch.Generator().manual_seed(3)).tolist()
    request = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert engine.num_steps == 8  # the prompt in one step, then seven decode steps
    tokens, logits = hf_greedy(reference, prompt, 8)
    assert_same_greedy(request.output_token_ids, recorder.steps[request.request_id], tokens, logits)


def pairs_kernel(bf16: bool = True) -> half_matmul.HalfMatmulKernel:
    if bf16 and not half_matmul.pairs_native():
        pytest.skip("no AVX512-BF16 here: pairs run in plain C only")
    return kernel() if bf16 else kernel_without_bf16()


def kernel_without_bf16() -> half_matmul.HalfMatmulKernel:
    built, why = half_matmul.load(bf16=False)
    if built is None:
        pytest.skip(why)
    return built


def test_pairs_hold_the_rows() -> None:
    rows = weights(37, 21, torch.bfloat16)
    pairs = HalfWeight.from_rows(rows, pairs=True)
    assert pairs.panels.shape == (3, 11, PANEL, 2) and (pairs.out_features, pairs.in_features) == (37, 21)
    assert torch.equal(pairs.rows(torch.tensor([36, 0, 17, 16])), rows[[36, 0, 17, 16]])
    assert not pairs.panels[:, 10, :, 1].any() and not pairs.panels[2, :, 5:].any()  # past in and out: 0
    with pytest.raises(ValueError, match=r"pairs multiply bfloat16 weights, not torch\.float16"):
        HalfWeight.from_rows(weights(4, 4, torch.float16), pairs=True)


@pytest.mark.parametrize("bf16", [True, False], ids=["vdpbf16ps", "plain-c"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_pairs_multiply_the_rows_rounded_to_bfloat16(bf16: bool, out_features: int, in_features: int) -> None:
    """Against float64 over x rounded to bfloat16 (torch's rounding: to nearest, ties to even): within
    float32 summation; each row alone in any batch, split or not; strided rows as contiguous ones."""
    w = weights(out_features, in_features, torch.bfloat16)
    pairs = HalfWeight.from_rows(w, pairs=True)
    x = torch.randn(max(ROW_COUNTS), in_features, generator=torch.Generator().manual_seed(1))
    full = pairs_kernel(bf16)(x, pairs)
    exact = x.bfloat16().double() @ w.double().T
    assert (full.double() - exact).abs().max() <= 1e-5 * in_features**0.5 * max(1.0, float(exact.abs().max()))
    unrounded = (full.double() - x.double() @ w.double().T).abs().max()
    assert unrounded > 1e-4 * max(1.0, float(exact.abs().max()))  # the rows were rounded, not kept exact
    for count in ROW_COUNTS:
        assert torch.equal(pairs_kernel(bf16)(x[:count], pairs), full[:count]), count
        assert torch.equal(pairs_kernel(bf16)(x[:count], pairs, split=True), full[:count]), count
    strided = torch.randn(5, in_features + 3)[:, :in_features]
    assert torch.equal(pairs_kernel(bf16)(strided, pairs), pairs_kernel(bf16)(strided.contiguous(), pairs))


def test_vdpbf16ps_is_its_definition_in_plain_c() -> None:
    """Intel's order for each lane (the odd k's product added, then the even k's; products exact in
    float32), on one thread or two: what a CPU without AVX512-BF16 computes is what this one does."""
    pairs = HalfWeight.from_rows(weights(300, 575, torch.bfloat16), pairs=True)
    x = torch.randn(30, 575, generator=torch.Generator().manual_seed(2))
    one, two = on_one_then_two_threads(lambda: pairs_kernel()(x, pairs, split=True))
    assert torch.equal(one, two) and torch.equal(kernel_without_bf16()(x, pairs), one)
