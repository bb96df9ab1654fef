"""The offline API (kvfence.LLM) on the real SmolLM2, loaded as `LLM()` loads it, against the server's
answers for the same prompts (greedy: the same tokens), batched and in order."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from conftest import real_engine, serving

from kvfence import LLM, SamplingParams
from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
# The exact float32 path on both sides (real_engine's), so greedy tokens agree bit for bit.
ENGINE = {"num_pages": 64, "max_model_len": 512}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", activation_dtype="float32", enforce_eager=True, **ENGINE)


@pytest.fixture(scope="module")
def server(smollm2: GGUFModel) -> Iterator[str]:
    with serving(build_app(AsyncEngine(real_engine(smollm2, **ENGINE)), "smollm2", None, None)) as url:
        yield url


def ask(server: str, path: str, body: dict[str, object]) -> dict[str, object]:
    body = body | {"temperature": 0, "max_tokens": MAX_TOKENS}
    response = httpx.post(f"{server}/v1/{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_generate_answers_what_the_server_answers_in_input_order(
    llm: LLM, server: str, one_torch_thread: None
) -> None:
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        served = ask(server, "completions", {"prompt": prompt})
        (choice,) = output.outputs
        assert output.prompt == prompt
        assert output.prompt_token_ids == tokenizer.encode(prompt, add_special_tokens=True)
        assert (choice.text, choice.finish_reason) == (served["text"], served["finish_reason"])
        assert choice.text and tokenizer.decode(choice.token_ids) == choice.text


def test_chat_renders_the_template_and_answers_what_the_server_answers(
    llm: LLM, server: str, one_torch_thread: None
) -> None:
    outputs = llm.chat(CHATS, GREEDY, use_tqdm=False)
    for conversation, output in zip(CHATS, outputs, strict=True):
        served = ask(server, "chat/completions", {"messages": conversation})
        assert output.prompt is not None and output.prompt.startswith("<|im_start|>")  # SmolLM2's template
        assert output.prompt.endswith("<|im_start|>assistant\n")  # the generation prompt
        assert output.outputs[0].text == served["message"]["content"]  # type: ignore[index]
        assert output.outputs[0].finish_reason == served["finish_reason"]


def test_stop_strings_and_n_as_vllm(llm: LLM, one_torch_thread: None) -> None:
    (full,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    cut_at = full.outputs[0].text.split()[1]  # the answer's second word
    (stopped,) = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, stop=cut_at), False)
    assert stopped.outputs[0].finish_reason == "stop"
    assert full.outputs[0].text.startswith(stopped.outputs[0].text) and cut_at not in stopped.outputs[0].text
    (sampled,) = llm.generate(PROMPTS[2], SamplingParams(n=2, seed=3, max_tokens=4), use_tqdm=False)
    assert [c.index for c in sampled.outputs] == [0, 1] and all(c.token_ids for c in sampled.outputs)


def test_bad_words_are_banned_as_the_server_bans_them(llm: LLM, server: str, one_torch_thread: None) -> None:
    (full,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    banned = full.outputs[0].text.split()[0]  # the greedy answer's first word ("Paris")
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, bad_words=[banned])
    (output,) = llm.generate(PROMPTS[0], params, use_tqdm=False)
    served = ask(server, "completions", {"prompt": PROMPTS[0], "bad_words": [banned]})
    assert banned not in output.outputs[0].text and output.outputs[0].text == served["text"]
