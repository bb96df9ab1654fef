"""n > 1 with per-sequence state through the disaggregated router: decode compiles the guide once and gives
each fork its own matcher, the router's API gives each choice its own logprobs and tool-call parser."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from test_disagg_e2e import MODEL, client, disaggregated

from kvfence.harness.cluster import Cluster

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 16}},
    "required": ["city"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Name a large city in France as JSON."}]


@pytest.fixture(scope="module")
def fenced() -> Iterator[Cluster]:
    with disaggregated(isolation=True) as running:
        yield running


def test_n_choices_under_a_schema_with_logprobs_through_the_router(fenced: Cluster) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    reply = client(fenced, "key-a").chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=24,
        temperature=1.0,
        seed=5,
        n=3,
        logprobs=True,
        response_format=response_format,  # type: ignore[arg-type]
    )
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        assert choice.finish_reason == "stop" and set(json.loads(choice.message.content or "")) == {"city"}
        tokens = [t.token for t in choice.logprobs.content or []] if choice.logprobs else []
        assert "".join(tokens).removesuffix("<|im_end|>") == choice.message.content


def test_n_choices_with_a_forced_tool_through_the_router(fenced: Cluster) -> None:
    tool = {"type": "function", "function": {"name": "locate", "parameters": CITY}}
    reply = client(fenced, "key-a").chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=1.0,
        seed=5,
        n=2,
        tools=[tool],  # type: ignore[list-item]
        tool_choice="required",
    )
    for choice in reply.choices:
        (call,) = choice.message.tool_calls or []
        assert choice.finish_reason == "tool_calls" and call.function.name == "locate"  # type: ignore[union-attr]
        assert set(json.loads(call.function.arguments)) == {"city"}  # type: ignore[union-attr]
