"""n > 1 with per-sequence state, on the tiny byte-level model: each fork its own grammar matcher (structured
output, forced tool calls), each choice its own logprobs formatter and tool-call parser, streamed and not."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from starlette.testclient import TestClient
from test_grammar import SCHEMAS, WEATHER, tiny_engine, tiny_tokenizer

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.grammar.compiler import GrammarCompiler
from kvfence.request import Status
from kvfence.sampling import SamplingParams

SCHEMA = SCHEMAS["required_fields"]
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
# ASCII only, so that every token's own decode is whole characters and the tokens join to the text; longer
# than max_tokens, so that no EOS (a token without text) ends it.
WORDS = "[a-z ]{40,50}"
MESSAGES = [{"role": "user", "content": "hi"}]
SEEDED: dict[str, Any] = {"model": "tiny", "max_tokens": 60, "temperature": 1.0, "seed": 11}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(build_app(AsyncEngine(tiny_engine(tiny_tokenizer())), "tiny", None, None)) as test_client:
        yield test_client


def test_each_fork_gets_a_matcher_of_its_own() -> None:
    """Were the forks to share one matcher, each step would feed it every fork's token: an error at once."""
    engine = tiny_engine(tiny_tokenizer())
    grammar = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size).for_schema(SCHEMA)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=3)
    parent = engine.add_request(engine.tokenizer.encode("JSON: "), params, grammar=grammar, n=3)  # type: ignore[union-attr]
    matchers = {id(fork.grammar.matcher) for fork in parent.forks if fork.grammar is not None}
    assert len(matchers) == 3 and id(grammar.matcher) not in matchers
    while not all(fork.is_finished for fork in parent.forks):
        engine.step()
    texts = [fork.output_text for fork in parent.forks]
    for fork in parent.forks:
        assert (fork.status, fork.finish_reason) == (Status.FINISHED, "stop"), fork.output_text
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(fork.output_text))
    assert len(set(texts)) > 1, texts


def test_n3_json_schema_every_choice_follows_it(client: TestClient) -> None:
    body = SEEDED | {"n": 3, "messages": MESSAGES, "response_format": JSON_FORMAT}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    texts = [c["message"]["content"] for c in choices]
    for choice, text in zip(choices, texts, strict=True):
        assert choice["finish_reason"] == "stop"
        assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(text)), text
    assert len(set(texts)) > 1, texts  # three seeds, three samples
    streamed = _streamed(client, "/v1/chat/completions", body)
    assert [streamed["text"][i] for i in range(3)] == texts
    assert streamed["finish"] == {0: "stop", 1: "stop", 2: "stop"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_n2_logprobs_each_choice_its_own(client: TestClient, path: str) -> None:
    chat = path.endswith("chat/completions")
    body = SEEDED | {"n": 2, "max_tokens": 12, "guided_regex": WORDS, "logprobs": True if chat else 2}
    body |= {"messages": MESSAGES, "top_logprobs": 2} if chat else {"prompt": "JSON: "}
    reply = client.post(path, json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    texts = [c["message"]["content"] if chat else c["text"] for c in choices]
    assert len(set(texts)) == 2, texts
    for choice, text in zip(choices, texts, strict=True):
        tokens = _tokens(choice["logprobs"], chat)
        assert "".join(tokens) == text
        if not chat:  # its own text_offset, from 0
            assert choice["logprobs"]["text_offset"][0] == 0
    streamed = _streamed(client, path, body)
    assert [streamed["text"][i] for i in range(2)] == texts
    assert ["".join(streamed["tokens"][i]) for i in range(2)] == texts


def test_n2_prompt_logprobs_with_every_choice(client: TestClient) -> None:
    body = SEEDED | {"n": 2, "max_tokens": 3, "prompt": "JSON: ", "prompt_logprobs": 1}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    first, second = reply.json()["choices"]
    assert first["prompt_logprobs"] and first["prompt_logprobs"] == second["prompt_logprobs"]
    assert first["prompt_logprobs"][0] is None and len(first["prompt_logprobs"]) > 1


@pytest.mark.parametrize(
    "tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"]
)
def test_n2_forced_tool_every_choice_calls_it(client: TestClient, tool_choice: Any) -> None:
    body = SEEDED | {"n": 2, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": tool_choice}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    choices = reply.json()["choices"]
    calls = []
    for choice in choices:
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert call["function"]["name"] == "get_weather"
        calls.append(call)
    assert calls[0]["id"] != calls[1]["id"]
    arguments = [json.loads(call["function"]["arguments"]) for call in calls]
    assert all(isinstance(a, dict) and set(a) == {"unit", "days"} for a in arguments)
    streamed = _streamed(client, "/v1/chat/completions", body)
    assert streamed["finish"] == {0: "tool_calls", 1: "tool_calls"}
    assert [json.loads(streamed["arguments"][i]) for i in range(2)] == arguments
    assert streamed["names"] == {0: ["get_weather"], 1: ["get_weather"]}


def _tokens(logprobs: dict[str, Any] | None, chat: bool) -> list[str]:
    if logprobs is None:
        return []
    return [entry["token"] for entry in logprobs["content"]] if chat else logprobs["tokens"]


def _streamed(client: TestClient, path: str, body: dict[str, Any]) -> dict[str, dict[int, Any]]:
    """Per choice index: its text, its logprobs tokens, its finish, its tool calls' names and arguments."""
    chat = path.endswith("chat/completions")
    with client.stream("POST", path, json=body | {"stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    seen: dict[str, dict[int, Any]] = {
        "text": defaultdict(str),
        "tokens": defaultdict(list),
        "finish": {},
        "names": defaultdict(list),
        "arguments": defaultdict(str),
    }
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            index = choice["index"]
            part = choice["delta"] if chat else choice
            seen["text"][index] += part.get("content" if chat else "text") or ""
            seen["tokens"][index] += _tokens(choice.get("logprobs"), chat)
            for call in part.get("tool_calls") or [] if chat else []:
                if call["function"].get("name"):
                    seen["names"][index].append(call["function"]["name"])
                seen["arguments"][index] += call["function"].get("arguments") or ""
            if choice.get("finish_reason"):
                seen["finish"][index] = choice["finish_reason"]
    return seen
