"""What vLLM answers, answered alike on the real SmolLM2 (issue 48): requests vLLM refuses are 400s naming
the field; /ping and HEAD /health; the detokenizing, masking, truncating and rendering extras
(skip_special_tokens, allowed_token_ids, bad_words, truncate_prompt_tokens, return_token_ids,
return_tokens_as_token_ids, continue_final_message); and a list of prompts in /v1/completions."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import real_engine, serving

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

MODEL = "smollm2-parity"
WINDOW = 256
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=WINDOW))
    with serving(build_app(engine, MODEL, None, None)) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=60)


def ok(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(url, path, body)
    assert response.status_code == 200, response.text
    return response.json()


def refused(url: str, path: str, body: dict[str, Any], param: str) -> str:
    response = post(url, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    return str(error["message"])


def complete(url: str, **extra: Any) -> dict[str, Any]:
    return ok(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8} | extra)["choices"][0]


def tokens(url: str, text: str, special: bool = False) -> list[int]:
    return ok(url, "/tokenize", {"prompt": text, "add_special_tokens": special})["tokens"]


def detokenize(url: str, ids: list[int]) -> str:
    return ok(url, "/detokenize", {"tokens": ids})["prompt"]


# ---- silent accepts are 400s ------------------------------------------------------------------------------


def test_what_vllm_refuses_is_a_400_naming_the_field(url: str) -> None:
    completions, chat = "/v1/completions", "/v1/chat/completions"
    base = {"prompt": PROMPT}
    message = refused(url, completions, base | {"max_tokens": 4, "min_tokens": 5}, "min_tokens")
    assert "max_tokens (4)" in message
    refused(url, completions, base | {"stream_options": {"include_usage": True}}, "stream_options")
    refused(url, completions, base | {"stop_token_ids": [2, 10**6]}, "stop_token_ids")
    refused(url, completions, base | {"allowed_token_ids": [10**6]}, "allowed_token_ids")
    tool = [*QUESTION, {"role": "tool", "content": "sunny"}]
    assert "tool_call_id" in refused(url, chat, {"messages": tool}, "messages")
    empty = [{"role": "user", "content": None}]
    assert "content" in refused(url, chat, {"messages": empty}, "messages")
    # Each at its sound value answers.
    complete(url, max_tokens=4, min_tokens=4, stop_token_ids=[2])
    assert post(url, completions, base | {"stream": True, "stream_options": {}}).status_code == 200


def test_ping_and_head_health(url: str) -> None:
    for method in ("GET", "POST"):
        response = httpx.request(method, f"{url}/ping", timeout=10)
        assert response.status_code == 200 and response.json() == {"status": "ok"}
    head = httpx.head(f"{url}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""


# ---- detokenizing and masks --------------------------------------------------------------------------------


def test_skip_special_tokens_and_allowed_token_ids(url: str) -> None:
    """Allowed only <|im_start|> (a special token), the answer is that token over and over: its text shows
    only with skip_special_tokens false."""
    (start,) = tokens(url, "<|im_start|>")
    asked = {"allowed_token_ids": [start], "max_tokens": 3, "return_token_ids": True}
    kept = complete(url, skip_special_tokens=False, **asked)
    assert kept["token_ids"] == [start] * 3 and kept["text"] == "<|im_start|>" * 3
    assert complete(url, **asked)["text"] == ""


def test_allowed_token_ids_confine_every_sampled_token(url: str) -> None:
    allowed = tokens(url, " Lyon") + tokens(url, " London") + tokens(url, ".")
    for sampling in ({}, {"temperature": 1.0, "seed": 7}):
        choice = complete(url, allowed_token_ids=allowed, return_token_ids=True, **sampling)
        assert choice["token_ids"] and set(choice["token_ids"]) <= set(allowed), choice


def test_bad_words_ban_a_word_wherever_it_would_be_written(url: str) -> None:
    plain = complete(url, return_token_ids=True)
    assert "Paris" in plain["text"]
    banned = complete(url, bad_words=["Paris"], return_token_ids=True)
    assert "Paris" not in banned["text"]
    assert not set(tokens(url, " Paris")) & set(banned["token_ids"])


# ---- prompts, renderings ---------------------------------------------------------------------------------


def test_truncate_prompt_tokens_keeps_the_last_tokens(url: str) -> None:
    long_prompt = "Once upon a time there was a cat. " * 4 + PROMPT
    ids = tokens(url, long_prompt, special=True)
    cut = complete(url, prompt=long_prompt, truncate_prompt_tokens=6, return_token_ids=True)
    assert cut["prompt_token_ids"] == ids[-6:]
    assert cut["text"] == complete(url, prompt=ids[-6:])["text"]
    whole = complete(url, prompt=long_prompt, truncate_prompt_tokens=-1, return_token_ids=True)
    assert whole["prompt_token_ids"] == ids
    chat = {"messages": QUESTION, "max_tokens": 2, "truncate_prompt_tokens": 3}
    assert ok(url, "/v1/chat/completions", chat)["usage"]["prompt_tokens"] == 3
    too_many = {"prompt": PROMPT, "truncate_prompt_tokens": WINDOW + 1}
    assert str(WINDOW) in refused(url, "/v1/completions", too_many, "truncate_prompt_tokens")


def test_return_token_ids_and_tokens_as_token_ids(url: str) -> None:
    choice = complete(url, return_token_ids=True, logprobs=2, return_tokens_as_token_ids=True)
    assert choice["prompt_token_ids"] == tokens(url, PROMPT, special=True)
    assert detokenize(url, choice["token_ids"]) == choice["text"]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in logprobs["top_logprobs"] for key in top)
    plain = complete(url, logprobs=2)["logprobs"]
    assert logprobs["text_offset"] == plain["text_offset"] and plain["tokens"][0] != logprobs["tokens"][0]
    asked = {"logprobs": True, "return_token_ids": True, "return_tokens_as_token_ids": True}
    chat = ok(url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4} | asked)
    ids = chat["choices"][0]["token_ids"]
    assert chat["prompt_token_ids"] == ok(url, "/tokenize", {"messages": QUESTION})["tokens"]
    assert [entry["token"] for entry in chat["choices"][0]["logprobs"]["content"]] == [
        f"token_id:{t}" for t in ids
    ]


def stream_chunks(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}{path}", json=body | {"stream": True}, timeout=60) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_return_token_ids_streams_each_chunks_ids_and_the_prompts_once(url: str, path: str) -> None:
    """Streamed, every choice's chunks carry its ids since its chunk before (together: the ids a body
    returns, and they decode to its text), the prompt's with its first chunk only; n = 2 alike, each
    choice its own, streamed and not."""
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"max_tokens": 8, "return_token_ids": True}
    body |= {"messages": QUESTION} if chat else {"prompt": PROMPT}
    whole = ok(url, path, body)
    prompt = whole["prompt_token_ids"] if chat else whole["choices"][0]["prompt_token_ids"]
    chunks = stream_chunks(url, path, body)
    carried = [c.get("prompt_token_ids") if chat else c["choices"][0].get("prompt_token_ids") for c in chunks]
    assert carried[0] == prompt and not any(carried[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == whole["choices"][0]["token_ids"]
    sampled = body | {"n": 2, "temperature": 1.0, "seed": 7}
    both = ok(url, path, sampled)["choices"]
    texts = [c["message"]["content"] if chat else c["text"] for c in both]
    assert [detokenize(url, c["token_ids"]) for c in both] == texts
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for chunk in stream_chunks(url, path, sampled):
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["token_ids"]
    assert [streamed[0], streamed[1]] == [c["token_ids"] for c in both]


def test_continue_final_message_continues_the_assistants_text(url: str) -> None:
    started = [*QUESTION, {"role": "assistant", "content": "The capital of France is"}]
    body = {"messages": started, "max_tokens": 4, "return_token_ids": True}
    refused(url, "/v1/chat/completions", body | {"continue_final_message": True}, "continue_final_message")
    asked = body | {"continue_final_message": True, "add_generation_prompt": False}
    answer = ok(url, "/v1/chat/completions", asked)
    prompt = answer["prompt_token_ids"]
    closed = ok(url, "/tokenize", {"messages": started, "add_generation_prompt": False})["tokens"]
    assert detokenize(url, prompt) + detokenize(url, closed[len(prompt) :]) == detokenize(url, closed)
    assert len(prompt) < len(closed) and detokenize(url, prompt).endswith("The capital of France is")
    same = complete(url, prompt=prompt, max_tokens=4)
    assert answer["choices"][0]["message"]["content"] == same["text"]


# ---- a batch of prompts -----------------------------------------------------------------------------------

ITALY = "The capital of Italy is"


def test_a_batch_of_prompts_is_answered_choice_by_choice(url: str) -> None:
    """Prompt i's sample j at index i * n + j, each the answer its prompt gets alone; usage summed."""
    alone = [ok(url, "/v1/completions", {"prompt": p, "max_tokens": 6}) for p in (PROMPT, ITALY)]
    texts = [answer["choices"][0]["text"] for answer in alone]
    assert texts[0] != texts[1]
    for prompt in ([PROMPT, ITALY], [tokens(url, PROMPT, True), tokens(url, ITALY, True)]):
        batch = ok(url, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "n": 2})
        assert [c["index"] for c in batch["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in batch["choices"]] == [texts[0], texts[0], texts[1], texts[1]]
        assert batch["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
        assert batch["usage"]["completion_tokens"] == 2 * sum(a["usage"]["completion_tokens"] for a in alone)
    refused(url, "/v1/completions", {"prompt": [PROMPT, ITALY], "stream": True}, "stream")
    refused(url, "/v1/completions", {"prompt": [PROMPT, [1, 2]]}, "prompt")
    outside = {"prompt": [[1, 2], [10**6]]}  # a token id outside the vocabulary
    assert "[0, " in refused(url, "/v1/completions", outside, "prompt")
