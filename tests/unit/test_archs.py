"""Every architecture against transformers: a tiny random model built with transformers' own config and
modelling class is written into a GGUF file (F32, F16, and every block format: gguf-py's quantizer where
it has one, random valid K-quant blocks where it has none), served by kvfence's engine, and its greedy
tokens and logits compared with transformers running the weights the file's bytes decode to.

Tolerance: logits within 2e-5 of the step's largest logit magnitude, and never under 1e-4 (float32 against
transformers in float64: our rounding alone); tokens exact, or a
divergence only where transformers' own top two logits were within 1e-3 (conftest.assert_same_greedy).
The engine runs with 4-token pages, prefill chunks of 8 tokens (chunks over cached pages), a shared
prefix (prefix-cache hits), and prompts longer than Gemma's sliding window of 8.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import LogitsRecorder, assert_same_greedy, make_engine
from hf_reference import Q, write_gguf

from kvfence.model.gguf import load_gguf
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

SHAPE = {  # hidden 256: K-quants pack 256 weights a block along the input features
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
WINDOW = 8


def hf_model(variant: str, seed: int = 0) -> torch.nn.Module:
    """A random float32 HF model of `variant`: an architecture, or llama with Llama 3's RoPE scaling."""
    torch.manual_seed(seed)
    if variant in ("llama", "llama3"):
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if variant == "llama3":
            rope = {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,  # small, so that some frequencies are smoothed
            }
        config = transformers.LlamaConfig(
            **SHAPE, num_hidden_layers=2, rope_parameters=rope, tie_word_embeddings=variant == "llama3"
        )
        model = transformers.LlamaForCausalLM(config)
    elif variant == "qwen2":
        config = transformers.Qwen2Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(config)
    elif variant == "qwen3":
        config = transformers.Qwen3Config(**SHAPE, num_hidden_layers=2, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(config)
    else:
        config = transformers.Gemma3TextConfig(
            **SHAPE, num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=SHAPE["head_dim"]
        )
        model = transformers.Gemma3ForCausalLM(config)
    config._attn_implementation = "eager"
    with torch.no_grad():  # decisive random weights: HF's init (std 0.02) leaves every logit near-tied
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 2.0 / param.shape[1] ** 0.5 if "embed" not in name else 0.3)
            else:  # norms around their identity (Gemma: 0, as it multiplies by 1 + w), biases small
                param.normal_(0.0 if variant == "gemma3" or "bias" in name else 1.0, 0.1)
    return model.eval()


ARCH = {"llama": "llama", "llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def every(kind: Q):
    return lambda _name, _weights: kind


def q4_k_m(name: str, _weights: np.ndarray) -> Q:
    """The mix of a llama.cpp Q4_K_M file such as the real Gemma 3 270M: Q5_0, Q8_0, Q4_K and Q6_K side by
    side, so fused projections join parts of different groups (Q6_K's 16 beside 32)."""
    for part, kind in (
        ("attn_v", Q.Q8_0),
        ("attn_output", Q.Q4_K),
        ("ffn_down", Q.Q6_K),
        ("token_embd", Q.Q8_0),
    ):
        if part in name:
            return kind
    return Q.Q5_0


KINDS = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K)
CASES = [(variant, kind.name, every(kind)) for variant in ARCH for kind in KINDS] + [
    ("gemma3", "Q4_K_M", q4_k_m)
]


def hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy continuation in float64, the whole sequence re-run at every step (no cache to
    trust). float64: the reference's own float32 rounding took a Q5_K case past the bound on a Sapphire
    Rapids Xeon (1.1x it; at most 0.34x against float64, every case)."""
    model, ids, logits = model.double(), list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            row = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(row)
            ids.append(int(row.argmax()))
    return ids[len(prompt) :], logits


def assert_engine_matches(model: Transformer, reference: torch.nn.Module, steps: int = 8) -> None:
    """An engine over `model` (pages of 4, chunks of 8) against transformers' `reference` on `prompts(1)`:
    the same greedy tokens, logits within the golden tolerance (conftest.assert_same_greedy)."""
    engine = make_engine(model, num_pages=64, page_size=4, max_num_batched_tokens=8, max_model_len=64)
    recorder = LogitsRecorder(engine)
    requests = engine.generate(prompts(1), SamplingParams(max_tokens=steps, ignore_eos=True))
    for prompt, request in zip(prompts(1), requests, strict=True):
        tokens, logits = hf_greedy(reference, prompt, steps)
        assert_same_greedy(request.output_token_ids, recorder.steps[request.request_id], tokens, logits)


def prompts(seed: int) -> list[list[int]]:
    """Two prompts sharing a 12-token prefix (prefix-cache hits at page size 4), longer than the window."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, SHAPE["vocab_size"], (12,), generator=gen).tolist()
    return [shared + torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (9, 14)]


@pytest.mark.parametrize(("variant", "quant", "kind_of"), CASES, ids=[f"{v}-{q}" for v, q, _ in CASES])
def test_greedy_tokens_and_logits_match_transformers(
    tmp_path: Path, variant: str, quant: str, kind_of
) -> None:
    reference = hf_model(variant)
    written = write_gguf(tmp_path / f"{variant}-{quant}.gguf", ARCH[variant], reference, kind_of)
    missing, unexpected = reference.load_state_dict(written.hf_weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head is the embedding
    loaded = load_gguf(written.path)
    assert loaded.config.architecture == ARCH[variant]
    blocks = quant not in ("F32", "F16")
    assert bool(loaded.quantized) == blocks and (quant in loaded.quantization or quant == "Q4_K_M")
    heard: list[str] = []
    model = Transformer.from_gguf(loaded, activation_dtype="float32", progress=heard.append)
    assert model.decode_matmul == ("kernel" if blocks else "dense") and model.decode_attention == "kernel"
    layers = loaded.config.num_layers
    assert heard[-1].startswith(f"{layers}/{layers} layers read and packed")
    if blocks and not loaded.config.tie_word_embeddings:  # the table packed apart from the head: every row
        table = loaded.quantized["token_embd.weight"].dequantize()
        assert torch.equal(model.embed(torch.arange(len(table))), table)
    assert_engine_matches(model, reference)
