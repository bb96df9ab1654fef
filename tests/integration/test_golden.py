"""The engine against HF transformers on the real SmolLM2 GGUF: greedy tokens and per-step logits.

Also the oracle the fence tests lean on: a batch of mixed requests produces each request's solo tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import LogitsRecorder, assert_same_greedy, real_engine

from kvfence.model.gguf import GGUFModel
from kvfence.sampling import SamplingParams

pytestmark = pytest.mark.real_model

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "List three prime numbers and explain why 9 is not prime."},
    ],
    [{"role": "user", "content": "Write a haiku about paged memory in GPUs."}],
]
NEW_TOKENS = 32


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], new_tokens: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Plain argmax decoding with HF's own KV cache: no logits processors (generate() would suppress EOS
    under min_new_tokens and pick the runner-up, which is not greedy)."""
    tokens: list[int] = []
    logits: list[torch.Tensor] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(new_tokens):
            step_logits = out.logits[0, -1].float()
            logits.append(step_logits)
            tokens.append(int(step_logits.argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logits


def test_greedy_tokens_and_logits_match_transformers(smollm2: GGUFModel, hf_smollm2: torch.nn.Module) -> None:
    engine = real_engine(smollm2)
    recorder = LogitsRecorder(engine)
    tok = engine.tokenizer
    assert tok is not None
    prompts = [tok.encode(tok.apply_chat_template(chat)) for chat in CHATS]
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt in prompts:
        request = engine.generate([prompt], params)[0]
        ref_tokens, ref_logits = hf_greedy(hf_smollm2, prompt, NEW_TOKENS)
        assert len(request.output_token_ids) == NEW_TOKENS
        assert_same_greedy(
            request.output_token_ids, recorder.steps[request.request_id], ref_tokens, ref_logits
        )


def test_batched_equals_solo(smollm2: GGUFModel) -> None:
    """8 requests of mixed lengths together produce exactly what each produces alone."""
    tok_engine = real_engine(smollm2)
    tok = tok_engine.tokenizer
    assert tok is not None
    texts = [
        "Hi",
        "Tell me about the moon.",
        "Count from one to ten in words, please, slowly.",
        "What is 17 times 23?",
        "Translate 'good morning' into Spanish and French.",
        "Name a color.",
        "Describe a cat in two sentences, using vivid and unusual words.",
        "Why is the sky blue? Answer like a physicist talking to a child.",
    ]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
    params = [SamplingParams(max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    solo_tokens, solo_logits = [], []
    for prompt, p in zip(prompts, params, strict=True):
        engine = real_engine(smollm2)
        recorder = LogitsRecorder(engine)
        request = engine.generate([prompt], p)[0]
        solo_tokens.append(request.output_token_ids)
        solo_logits.append(recorder.steps[request.request_id])
    engine = real_engine(smollm2, max_num_batched_tokens=96)  # forces chunked prefill beside decodes
    recorder = LogitsRecorder(engine)
    batch = engine.generate(prompts, params)
    assert engine.num_steps < sum(len(t) for t in solo_tokens), "requests were not batched together"
    for request, tokens, logits in zip(batch, solo_tokens, solo_logits, strict=True):
        assert_same_greedy(request.output_token_ids, recorder.steps[request.request_id], tokens, logits)
