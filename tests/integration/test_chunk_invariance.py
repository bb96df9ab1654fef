"""SmolLM2 on serving's default path (int8 activations, float16 pool): a prompt prefilled whole and in
chunks (a smaller step budget) gives the same logits, bit for bit, at every greedy step."""

from __future__ import annotations

import pytest
import torch
from conftest import LogitsRecorder, real_engine

from kvfence.model.gguf import GGUFModel
from kvfence.sampling import SamplingParams

pytestmark = pytest.mark.real_model

TEXT = (
    "The history of paged memory begins with the Atlas computer in Manchester, where a one-level store "
    "joined a drum to a small core memory and the machine moved pages between them on its own. "
) * 6


def greedy(smollm2: GGUFModel, budget: int, prompt_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """4 greedy tokens and their logits, the prompt prefilled in chunks of at most `budget` tokens."""
    engine = real_engine(
        smollm2, activation_dtype="auto", num_pages=64, max_model_len=512, max_num_batched_tokens=budget
    )
    assert engine.model.activation_dtype == "int8" and engine.pool.kv.dtype == torch.float16
    recorder = LogitsRecorder(engine)
    tok = engine.tokenizer
    assert tok is not None
    prompt = tok.encode(TEXT)[:prompt_tokens]
    [request] = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
    return request.output_token_ids, recorder.steps[request.request_id]


def test_a_prompt_prefilled_in_chunks_gives_the_logits_it_gives_whole(smollm2: GGUFModel) -> None:
    tokens, logits = greedy(smollm2, 512, 200)
    for budget in (64, 93):  # 64 + 64 + 64 + 8, and 93 + 93 + 14
        chunked_tokens, chunked_logits = greedy(smollm2, budget, 200)
        assert chunked_tokens == tokens
        for step, (a, b) in enumerate(zip(chunked_logits, logits, strict=True)):
            assert torch.equal(a, b), f"budget {budget}, step {step}: {(a - b).abs().max():.3g} apart"
