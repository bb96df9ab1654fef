"""n > 1 through the HTTP API on the real SmolLM2: choices with their indexes, streamed and not, usage over
every choice, reproducible under a seed, and the forks on the audit trail sharing the prompt's pages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import real_engine, serving

from kvfence.api.server import build_app
from kvfence.audit.trail import held_pages
from kvfence.engine.async_engine import AsyncEngine
from kvfence.harness.server import metric
from kvfence.model.gguf import GGUFModel
from kvfence.request import fork_id

pytestmark = pytest.mark.real_model

MODEL = "smollm2-n"
KEY, ADMIN = "key-n", "admin-n"
# Long enough for a full page of the prompt to be shared (16 tokens a page).
QUESTION = "Name a colour, then describe where it appears in nature, in a sentence."
MESSAGES = [{"role": "user", "content": QUESTION}]
SEEDED: dict[str, Any] = {"n": 3, "max_tokens": 8, "temperature": 1.0, "seed": 7}


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=512))
    with serving(build_app(engine, MODEL, {KEY: "tenant-n"}, ADMIN)) as running:
        yield running


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_three_choices_with_indexes_usage_and_seeded_reproducibility(url: str) -> None:
    reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    assert all(texts) and all(c.finish_reason in ("stop", "length") for c in reply.choices)
    assert len(set(texts)) > 1  # three seeds, three samples
    assert reply.usage is not None
    assert reply.usage.completion_tokens > 3 and reply.usage.completion_tokens <= 3 * 8
    again = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert [c.message.content for c in again.choices] == texts

    stream = client(url).chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **SEEDED
    )
    chunks = list(stream)
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    finishes = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2]
    assert (
        chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    )


def test_forks_share_the_prompts_pages_on_the_audit_trail(url: str) -> None:
    reply = client(url).completions.create(model=MODEL, prompt=QUESTION, **SEEDED)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    trails = [_trail(url, fork_id(reply.id, i)) for i in range(3)]
    forked = [trail[0] for trail in trails]
    assert all(f["kind"] == "forked" and f["parent"] == reply.id for f in forked)
    assert forked[0]["shared"] and forked[0]["shared"] == forked[1]["shared"] == forked[2]["shared"]
    copies = [page for f in forked for page in f["copied"]]
    assert len(set(copies)) == len(copies)  # each fork its own copy of the partial page
    assert [e["kind"] for e in _trail(url, reply.id)][-3:] == ["forked", "released", "finished"]
    # The audit reads a fork's mapping from that event: every page it held, it released.
    for trail, event in zip(trails, forked, strict=True):
        assert held_pages(trail[:1]) == set(event["pages"]) and not held_pages(trail)


def generated_tokens(url: str) -> float:
    return metric(url, "kvfence_generation_tokens_total", {"model_name": MODEL}, ADMIN)


def test_metrics_count_every_choice(url: str) -> None:
    before = generated_tokens(url)
    reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    assert reply.usage is not None
    assert generated_tokens(url) - before == reply.usage.completion_tokens  # all three choices' tokens


def test_iteration_tokens_sum_the_prompt_computed_once_and_every_choices_tokens(url: str) -> None:
    names = [
        "kvfence_iteration_tokens_sum",
        "kvfence_prompt_tokens_total",
        "kvfence_prefix_cache_hit_tokens_total",
        "kvfence_generation_tokens_total",
    ]
    before = [metric(url, name, {"model_name": MODEL}, ADMIN) for name in names]
    reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **SEEDED)  # type: ignore[call-overload]
    steps, prompt, cached, generated = (
        metric(url, name, {"model_name": MODEL}, ADMIN) - was for name, was in zip(names, before, strict=True)
    )
    assert reply.usage is not None and generated == reply.usage.completion_tokens
    assert prompt == reply.usage.prompt_tokens and steps == prompt - cached + generated


def test_n_out_of_range_or_best_of_other_than_n_is_400(url: str) -> None:
    for extra in ({"n": 0}, {"n": 17}, {"n": 2, "best_of": 3}):
        with pytest.raises(openai.BadRequestError) as info:
            client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body=extra)
        assert info.value.param == next(reversed(extra))
    ok = client(url).completions.create(model=MODEL, prompt="Hi", max_tokens=2, n=2, best_of=2)
    assert len(ok.choices) == 2


SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "maxLength": 12}, "warm": {"type": "boolean"}},
    "required": ["colour", "warm"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_three_choices_under_a_json_schema_each_follow_it(url: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "colour", "schema": SCHEMA, "strict": True}}
    reply = client(url).chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=MESSAGES, response_format=fmt, **(SEEDED | {"max_tokens": 40})
    )
    texts = [c.message.content for c in reply.choices]
    for choice in reply.choices:
        parsed = json.loads(choice.message.content or "")
        assert choice.finish_reason == "stop" and set(parsed) == {"colour", "warm"}, parsed
        assert isinstance(parsed["colour"], str) and isinstance(parsed["warm"], bool)
    assert len(set(texts)) > 1, texts  # three seeds, three samples


@pytest.mark.parametrize("stream", [False, True])
def test_two_choices_with_logprobs_each_join_to_its_text(url: str, stream: bool) -> None:
    asked = {"n": 2, "max_tokens": 10, "temperature": 1.0, "seed": 3, "logprobs": True, "top_logprobs": 2}
    if not stream:
        reply = client(url).chat.completions.create(model=MODEL, messages=MESSAGES, **asked)  # type: ignore[call-overload]
        pairs = [
            (c.message.content, [t.token for t in c.logprobs.content or []] if c.logprobs else [])
            for c in reply.choices
        ]
    else:
        chunks = client(url).chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=MESSAGES, stream=True, **asked
        )
        texts, tokens = ["", ""], [[], []]  # type: ignore[var-annotated]
        for chunk in chunks:
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                tokens[c.index] += [t.token for t in c.logprobs.content or []] if c.logprobs else []
        pairs = list(zip(texts, tokens, strict=True))
    assert pairs[0][0] != pairs[1][0]
    for text, tokens in pairs:
        assert tokens and "".join(tokens).removesuffix("<|im_end|>") == text


def test_two_choices_with_a_forced_tool_each_call_it(url: str) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    reply = client(url).chat.completions.create(  # type: ignore[call-overload]
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice=named,
        **(SEEDED | {"n": 2, "max_tokens": 40}),
    )
    ids = set()
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city", "unit"}
        ids.add(call.id)
    assert len(ids) == 2


def _trail(url: str, request_id: str) -> list[dict[str, Any]]:
    response = httpx.get(
        f"{url}/v1/audit/requests/{request_id}", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["events"]
