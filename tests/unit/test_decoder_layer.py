"""The C decoder layer (model/decoder_layer.py) against the torch forward, on each architecture's tiny
model with quantized weights: the same tokens and logits within float32 rounding, in pure decode steps
(one C call for every layer) and in steps that mix prefill chunks with decode rows (C around the
attention), and a decode row's logits bit for bit the same in either kind of step."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS, LogitsRecorder, make_engine, quantize, tiny_tensors

from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def quantized_model(arch: str) -> Transformer:
    config = TINY_ARCHS[arch]
    tensors, codes = quantize(tiny_tensors(3, config))
    return Transformer(config, tensors, quantized=codes, activation_dtype="float32")


def run(model: Transformer, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Greedy answers with the prompts admitted together (mixed steps), and each request's logits."""
    engine = make_engine(model, max_num_batched_tokens=16)
    recorder = LogitsRecorder(engine)
    requests = engine.generate(prompts, PARAMS)
    return [r.output_token_ids for r in requests], [recorder.steps[r.request_id] for r in requests]


@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_the_c_layer_computes_what_the_torch_forward_does(arch: str) -> None:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19, 11)]
    fused = quantized_model(arch)
    assert fused._c_layers is not None, "float32 on CPU with every weight packed: the C layer runs"
    plain = quantized_model(arch)
    plain._c_layers = None  # the same weights through the torch forward
    ours, our_logits = run(fused, prompts)
    theirs, their_logits = run(plain, prompts)
    assert ours == theirs
    for mine, reference in zip(our_logits, their_logits, strict=True):
        for a, b in zip(mine, reference, strict=True):
            assert (a - b).abs().max() <= 1e-4 * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float16"])
def test_a_decode_row_is_the_same_in_a_pure_decode_step_and_beside_a_prefill(kv_cache_dtype: str) -> None:
    """Pure decode steps run every layer in one C call; mixed steps call the C layer around attention:
    the row's logits are bit for bit the same either way (batch invariance), over either pool."""
    model = quantized_model("gemma3")  # every feature: q/k norms, post norms, GeGLU, a sliding window
    prompt = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    # the same prefill chunks in both engines
    alone_engine = make_engine(model, max_num_batched_tokens=4, kv_cache_dtype=kv_cache_dtype)
    recorder = LogitsRecorder(alone_engine)
    alone = alone_engine.generate([prompt], PARAMS)[0]
    mixed_engine = make_engine(model, max_num_batched_tokens=4, kv_cache_dtype=kv_cache_dtype)
    mixed_recorder = LogitsRecorder(mixed_engine)
    first = mixed_engine.add_request(prompt, PARAMS)
    for _ in range(4):  # the prompt's prefill and its first decode steps, alone
        mixed_engine.step()
    mixed_engine.add_request(list(range(40)), SamplingParams(max_tokens=2))  # chunks beside its decode rows
    while mixed_engine.has_unfinished():
        mixed_engine.step()
    assert first.output_token_ids == alone.output_token_ids
    steps = zip(mixed_recorder.steps[first.request_id], recorder.steps[alone.request_id], strict=True)
    assert all(torch.equal(a, b) for a, b in steps)


def test_the_c_layer_rounds_k_and_v_into_a_float16_pool_as_torch_does() -> None:
    """Layer 0's K and V depend on the prompt alone, so the float32 pool holds what the C layer computed:
    the float16 pool must hold exactly that, rounded to nearest by torch's own conversion."""
    model = quantized_model("llama")
    prompt = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(6)).tolist()
    pools = {}
    for kv_cache_dtype in ("auto", "float16"):
        engine = make_engine(model, kv_cache_dtype=kv_cache_dtype)
        engine.generate([prompt], SamplingParams(max_tokens=1))  # the prompt's prefill, one C call a layer
        pools[kv_cache_dtype] = engine.pool.kv[0]
    assert pools["float16"].dtype == torch.float16 and pools["auto"].dtype == torch.float32
    assert pools["auto"].count_nonzero() > 0  # the prompt's slots were written
    assert torch.equal(pools["float16"], pools["auto"].half())
