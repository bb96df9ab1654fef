"""Sampling parameters through the HTTP API on the real SmolLM2, with the official `openai` client:
logprobs in both shapes (and streamed), penalties, min_p, top_k, logit_bias, the defaults (model and
max_tokens left out, greedy unless told), a 400 naming the parameter for each value out of range, and the
compatibility matrix: every parameter the openai client knows works, changes nothing by definition, or is a
400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import real_engine, serving
from openai.types import completion_create_params as completions
from openai.types.chat import completion_create_params as chat

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

MODEL = "smollm2-sampling"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=256))
    with serving(build_app(engine, MODEL, None, None)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/v1{path}", json=body, timeout=60)


def test_chat_logprobs_have_openai_shape_and_follow_greedy(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert len(content) == 5 and "".join(t.token for t in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_completion_logprobs_have_openai_shape(client: openai.OpenAI) -> None:
    reply = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0, logprobs=2
    )
    choice = reply.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 2 and top[token] == pytest.approx(logprob)


def test_streamed_logprobs_cover_every_token(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    tokens = [
        t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content or []
    ]
    assert chunks[-1].usage is not None and len(tokens) == chunks[-1].usage.completion_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "".join(t.token for t in tokens) == text


def test_logit_bias_top_k_and_penalties_reach_the_sampler(client: openai.OpenAI) -> None:
    forced = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={"42": 100}, logprobs=0
    )
    tokens = forced.choices[0].logprobs.tokens if forced.choices[0].logprobs else None
    assert tokens is not None and len(set(tokens)) == 1 and "".join(tokens) == forced.choices[0].text
    plain = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=0)
    penalised = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        max_tokens=12,
        temperature=0,
        presence_penalty=2,
        frequency_penalty=2,
        extra_body={"repetition_penalty": 3.0},
    )
    assert penalised.choices[0].message.content != plain.choices[0].message.content
    top1 = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.5, seed=1, extra_body={"top_k": 1}
    )
    min_p = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.5, seed=1, extra_body={"min_p": 1.0}
    )
    greedy = plain.choices[0].message.content
    assert top1.choices[0].message.content == min_p.choices[0].message.content == greedy


def test_model_and_max_tokens_may_be_left_out_and_the_default_is_greedy(url: str) -> None:
    replies = [post(url, "/chat/completions", {"messages": QUESTION}) for _ in range(2)]
    assert all(r.status_code == 200 for r in replies), replies[0].text
    bodies = [r.json() for r in replies]
    assert bodies[0]["model"] == MODEL and "Paris" in bodies[0]["choices"][0]["message"]["content"]
    assert bodies[0]["choices"][0]["message"] == bodies[1]["choices"][0]["message"]
    assert bodies[0]["choices"][0]["finish_reason"] == "stop"  # not cut at some hidden max_tokens


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/completions", {"logprobs": 21}, "logprobs"),
        ("/completions", {"logprobs": -1}, "logprobs"),
        ("/chat/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("/chat/completions", {"logit_bias": {"hello": 1}}, "logit_bias"),
        ("/chat/completions", {"logit_bias": {"49152": 1}}, "logit_bias"),
        ("/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
        ("/completions", {"frequency_penalty": -2.5}, "frequency_penalty"),
        ("/chat/completions", {"repetition_penalty": 0}, "repetition_penalty"),
        ("/chat/completions", {"repetition_penalty": 1e-300}, "repetition_penalty"),  # 0 in float32
        ("/chat/completions", {"min_p": 1.5}, "min_p"),
        ("/completions", {"top_k": -2}, "top_k"),
    ],
)
def test_out_of_range_is_a_400_naming_the_parameter(
    url: str, path: str, extra: dict[str, Any], param: str
) -> None:
    body = {"messages": QUESTION} if path == "/chat/completions" else {"prompt": "Hi"}
    response = post(url, path, body | {"max_tokens": 2} | extra)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# ---- the compatibility matrix: every parameter the openai client can send ------------------------------

# Tested to work (here, test_server.py, test_structured.py, test_parallel_sampling_api.py).
WORKS = {
    "model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
    "stop", "stream_options", "n", "logit_bias", "logprobs", "top_logprobs", "presence_penalty",
    "frequency_penalty", "response_format", "tools", "tool_choice", "parallel_tool_calls", "echo",
}  # fmt: skip
# Accepted: they identify a caller or hint at caching, and change no answer by OpenAI's own definition.
NO_EFFECT = {"user", "metadata", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
             "prompt_cache_retention"}  # fmt: skip
# Everything else asks for behaviour this server does not have: a value for each that asks for it.
REFUSED = {
    "audio": {"voice": "alloy", "format": "wav"},
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "moderation": {"enabled": True},
    "prediction": {"type": "content", "content": "Paris"},
    "reasoning_effort": "high",
    "store": True,
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    "modalities": ["text", "audio"],
    "service_tier": "priority",
    "suffix": " the end",
    "best_of": 3,
}


@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_every_openai_parameter_works_or_is_refused_by_name(url: str, path: str) -> None:
    """Nothing the official client can send is silently ignored: each parameter is implemented, changes no
    answer by definition, or is a 400 naming it. A parameter a newer client adds fails here until it is
    sorted into one of the three."""
    params = (chat if path == "/chat/completions" else completions).CompletionCreateParamsBase
    names = set(params.__annotations__)
    assert names <= WORKS | NO_EFFECT | set(REFUSED), (
        f"unsorted: {sorted(names - WORKS - NO_EFFECT - set(REFUSED))}"
    )
    body = {"messages": QUESTION} if path == "/chat/completions" else {"prompt": "The capital of France is"}
    for name in sorted(names & set(REFUSED)):
        response = post(url, path, body | {"max_tokens": 2, name: REFUSED[name]})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name, response.text
    hints = {"user": "u1", "metadata": {"k": "v"}, "safety_identifier": "s", "prompt_cache_key": "c"}
    plain = post(url, path, body | {"max_tokens": 4}).json()["choices"][0]
    hinted = post(url, path, body | {"max_tokens": 4} | {k: v for k, v in hints.items() if k in names})
    assert hinted.status_code == 200 and hinted.json()["choices"][0] == plain


def test_echo_returns_the_prompt_before_the_answer_with_its_logprobs(client: openai.OpenAI) -> None:
    """OpenAI's legacy completions: `echo` writes the prompt first; with `logprobs`, its tokens' logprobs
    come first too, the first token's null (nothing precedes it); a stream sends the prompt in its first
    chunk."""
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2)
    answer = plain.choices[0].text
    assert echoed.choices[0].text == prompt + answer
    logprobs = echoed.choices[0].logprobs
    assert logprobs is not None and "".join(logprobs.tokens) == prompt + answer
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    prompt_tokens = len(logprobs.tokens) - 4
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert logprobs.text_offset[prompt_tokens] == len(prompt)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, stream=True))
    assert (
        chunks[0].choices[0].text == prompt and "".join(c.choices[0].text for c in chunks) == prompt + answer
    )


def test_prompt_logprobs_follow_vllm(url: str) -> None:
    """vLLM's `prompt_logprobs`: per prompt token (the first null), token id -> logprob, rank and text, the
    prompt's own token among them; on both endpoints, and in a stream's first chunk."""
    for path, body in (
        ("/completions", {"prompt": "The capital of France is"}),
        ("/chat/completions", {"messages": QUESTION}),
    ):
        reply = post(url, path, body | {"max_tokens": 2, "prompt_logprobs": 3})
        assert reply.status_code == 200, reply.text
        entries = reply.json()["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and len(entries) == reply.json()["usage"]["prompt_tokens"]
        for entry in entries[1:]:
            assert 3 <= len(entry) <= 4 and all(
                set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values()
            )
            ranks = sorted(v["rank"] for v in entry.values())
            assert ranks[0] == 1 or len(entry) == 4  # the top 3 ranked 1..3; the prompt's own token anywhere
        streamed = post(url, path, body | {"max_tokens": 2, "prompt_logprobs": 1, "stream": True})
        first = next(line for line in streamed.text.splitlines() if line.startswith("data: {"))
        assert json.loads(first[6:])["choices"][0]["prompt_logprobs"][1] is not None
