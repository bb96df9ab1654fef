"""The engine's cache features on the real SmolLM2: prefix reuse, preemption, stop strings."""

from __future__ import annotations

import pytest
from conftest import real_engine

from kvfence.model.gguf import GGUFModel
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

pytestmark = pytest.mark.real_model

SYSTEM = (
    "You are a careful assistant for an airline. Answer in one short sentence, never invent flight "
    "numbers, and always mention that prices may change before booking is complete. Baggage rules differ "
    "by route and fare class, so point travellers to the conditions printed on their own ticket."
)
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def chat(gguf_engine: object, question: str) -> list[int]:
    tok = gguf_engine.tokenizer  # type: ignore[attr-defined]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return tok.encode(tok.apply_chat_template(messages))


def test_prefix_hit_gives_the_uncached_tokens(smollm2: GGUFModel) -> None:
    cold = real_engine(smollm2, enable_prefix_caching=False)
    second = chat(cold, "Can I bring a bicycle?")
    expected = cold.generate([second], GREEDY)[0].output_token_ids
    engine = real_engine(smollm2)
    engine.generate([chat(engine, "How early should I arrive?")], GREEDY, "acme")
    hit = engine.generate([second], GREEDY, "acme")[0]
    assert engine.prefix is not None and engine.prefix.hits >= 3  # the system prompt spans >= 3 pages
    assert hit.output_token_ids == expected
    hits = engine.prefix.hits
    engine.generate([second], GREEDY, "globex")
    assert engine.prefix.hits == hits, "tenant globex hit tenant acme's pages"


def test_preemption_on_the_real_model(smollm2: GGUFModel) -> None:
    """Prompts that fit together but whose answers do not: decode growth forces recompute preemption."""
    engine = real_engine(smollm2)
    tok = engine.tokenizer
    assert tok is not None
    questions = ["Name a fruit.", "What is two plus two?", "Say hello in German.", "Why do birds sing?"]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in questions]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    solo = [real_engine(smollm2).generate([p], params)[0].output_token_ids for p in prompts]
    pages = cdiv(max(len(p) for p in prompts) + params.max_tokens, 16) + 1
    small = real_engine(smollm2, num_pages=pages, max_model_len=pages * 16, enable_prefix_caching=False)
    requests = small.generate(prompts, params)
    assert sum(r.num_preemptions for r in requests) > 0
    assert [r.output_token_ids for r in requests] == solo
    assert all(r.status is Status.FINISHED for r in requests)


def test_stop_string_is_cut_and_never_streamed(smollm2: GGUFModel) -> None:
    engine = real_engine(smollm2)
    tok = engine.tokenizer
    assert tok is not None
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    )
    full = engine.generate([prompt], SamplingParams(max_tokens=16))[0].output_text
    assert "Paris" in full
    request = engine.add_request(prompt, SamplingParams(max_tokens=16, stop=["Paris"]))
    streamed = ""
    while not request.is_finished:
        streamed += "".join(o.new_text for o in engine.step() if o.request_id == request.request_id)
    assert request.finish_reason == "stop"
    assert streamed == request.output_text == full[: full.index("Paris")]
