"""Structured output and tools on the tiny random model: whatever the weights say, the grammar's mask makes
every output parse and validate against its schema (greedy and sampled), a forced tool call parses into
the named function, a schema llguidance cannot enforce is a 400 naming the problem, and a matcher that
fails mid-decode aborts its own request only."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import jsonschema_rs
import pytest
from conftest import TINY, tiny_model
from starlette.testclient import TestClient

from kvfence.api.protocol import ChatCompletionRequest, ResponseFormat
from kvfence.api.server import build_app
from kvfence.api.tools import ToolCallParser, forced_schema, template_messages, tool_guide
from kvfence.config import EngineConfig
from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.drafter import Drafted, Drafter
from kvfence.engine.engine import LLMEngine
from kvfence.grammar.compiler import GrammarCompiler, GrammarError, Guide, ascii_digits, lark_ascii_digits
from kvfence.grammar.mask import GRAMMAR_ERROR
from kvfence.grammar.strict import closed, strict_schema
from kvfence.model.tokenizer import Tokenizer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("{", '"'), ('"', ":"), ('"', ","), ("Ġ", '"')]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMAS: dict[str, dict[str, Any]] = {
    "required_fields": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
        "required": ["name", "ok"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 1,
        "maxItems": 4,
    },
    "nested": {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}, "tag": {"const": "p"}},
                "required": ["x", "tag"],
                "additionalProperties": False,
            }
        },
        "required": ["point"],
        "additionalProperties": False,
    },
    "numbers": {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 500}, "flag": {"type": "null"}},
        "required": ["n", "flag"],
        "additionalProperties": False,
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"enum": ["c", "f"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["unit", "days"],
            "additionalProperties": False,
        },
    },
}
OTHER_TOOL = {
    "type": "function",
    "function": {"name": "noop", "parameters": {"type": "object", "maxProperties": 0}},
}


def chat_body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [WEATHER, OTHER_TOOL],
        }
        | fields
    )


FORCED = {
    "named": chat_body(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
    "required": chat_body(tool_choice="required", parallel_tool_calls=False),
}


def byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, in byte order (the vocab's first 256 tokens)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    extra = iter(range(256, 512))
    return [chr(b if b in printable else next(extra)) for b in range(256)]


def tiny_metadata() -> dict[str, Any]:
    """A byte-level BPE vocab's GGUF metadata, with a ChatML template."""
    tokens = byte_alphabet() + [a + b for a, b in MERGES] + SPECIALS
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS),
        "tokenizer.ggml.merges": [f"{a} {b}" for a, b in MERGES],
        "tokenizer.ggml.eos_token_id": tokens.index("<|im_end|>"),
        "tokenizer.chat_template": CHATML,
    }


def tiny_tokenizer() -> Tokenizer:
    return Tokenizer(tiny_metadata())


TINY_TOKENIZER = tiny_tokenizer()


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return TINY_TOKENIZER


def tiny_engine(tokenizer: Tokenizer) -> LLMEngine:
    config = dataclasses.replace(TINY, vocab_size=tokenizer.vocab_size, context_length=1024)
    settings = EngineConfig(num_pages=256, page_size=16, max_num_batched_tokens=1024, max_model_len=1024)
    return LLMEngine(settings, tiny_model(seed=3, config=config), tokenizer, log=lambda _: None)


@pytest.fixture(scope="module")
def engine(tokenizer: Tokenizer) -> LLMEngine:
    return tiny_engine(tokenizer)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer, engine: LLMEngine) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, engine.model.config.vocab_size)


SAMPLINGS = {
    "greedy": SamplingParams(max_tokens=120),
    "seed-1": SamplingParams(max_tokens=120, temperature=1.0, seed=1),
    "seed-2": SamplingParams(max_tokens=120, temperature=0.8, seed=2),
}
PROMPT = "Answer in JSON: "


@pytest.fixture(scope="module")
def outputs(engine: LLMEngine, compiler: GrammarCompiler) -> dict[tuple[str, str], Request]:
    """Every schema under every sampling, the two forced tool calls, and one unconstrained row, decoded
    together in one batch: the masks are per row, so the free row beside them is not JSON."""
    prompt = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    requests = {
        (name, sampling): engine.add_request(prompt, params, grammar=compiler.for_schema(SCHEMAS[name]))
        for name in SCHEMAS
        for sampling, params in SAMPLINGS.items()
    }
    for choice, body in FORCED.items():
        grammar = compiler.for_schema(forced_schema(body))  # type: ignore[arg-type]
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=5)
        requests["tool", choice] = engine.add_request(prompt, params, grammar=grammar)
    requests["free", "greedy"] = engine.add_request(prompt, SamplingParams(max_tokens=30))
    while not all(r.is_finished for r in requests.values()):
        engine.step()
    return requests


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("sampling", sorted(SAMPLINGS))
def test_outputs_parse_and_validate(
    outputs: dict[tuple[str, str], Request], name: str, sampling: str
) -> None:
    request = outputs[name, sampling]
    assert (request.status, request.finish_reason) == (Status.FINISHED, "stop")
    assert jsonschema_rs.validator_for(SCHEMAS[name]).is_valid(json.loads(request.output_text)), (
        request.output_text
    )


def test_without_the_mask_the_random_model_writes_no_json(outputs: dict[tuple[str, str], Request]) -> None:
    """The control: the same prompt unconstrained is not JSON, so the mask is what makes the outputs valid."""
    with pytest.raises(json.JSONDecodeError):
        json.loads(outputs["free", "greedy"].output_text)


def test_json_object_mode(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    """response_format json_object is the schema {"type": "object"}: every row opens an object, and every row
    that ends closes it (a random model's free strings often use up the tokens first: that is "length")."""
    schema = ResponseFormat(type="json_object").output_schema()
    assert schema == {"type": "object"}
    prompt = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    requests = [
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=24, temperature=1.0, seed=seed),
            grammar=compiler.for_schema(schema),
        )
        for seed in range(6)
    ]
    while not all(r.is_finished for r in requests):
        engine.step()
    for request in requests:
        assert request.output_text.startswith("{")
        if request.finish_reason == "stop":
            assert isinstance(json.loads(request.output_text), dict)


def test_a_schema_is_compiled_once(tokenizer: Tokenizer, engine: LLMEngine) -> None:
    compiler = GrammarCompiler(tokenizer, engine.model.config.vocab_size)
    first = compiler.for_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    again = compiler.for_schema(
        {"properties": {"a": {"type": "integer"}}, "type": "object"}
    )  # same, reordered
    assert compiler.compilations == 1 and first.matcher is not again.matcher


def test_unsupported_schema_names_the_feature(compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarError, match='"if"'):
        compiler.for_schema({"type": "object", "if": {"required": ["a"]}})


def test_a_matcher_error_aborts_that_request_alone(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    prompt = engine.tokenizer.encode("Answer in JSON: ")  # type: ignore[union-attr]
    broken = compiler.for_schema(SCHEMAS["enum"])
    broken.advance(engine.tokenizer.encode("x")[0])  # type: ignore[union-attr]  # not JSON: the matcher fails
    healthy = compiler.for_schema(SCHEMAS["enum"])
    bad = engine.add_request(prompt, SamplingParams(max_tokens=40), grammar=broken)
    good = engine.add_request(prompt, SamplingParams(max_tokens=40), grammar=healthy)
    while not (bad.is_finished and good.is_finished):
        engine.step()
    assert (bad.status, bad.finish_reason) == (Status.ABORTED, GRAMMAR_ERROR)
    assert good.status is Status.FINISHED and json.loads(good.output_text)["color"] in {
        "red",
        "green",
        "blue",
    }


@pytest.mark.parametrize("choice", sorted(FORCED))
def test_a_forced_tool_call_parses(outputs: dict[tuple[str, str], Request], choice: str) -> None:
    text = outputs["tool", choice].output_text
    parser = ToolCallParser(FORCED[choice])
    assert parser.feed(text) == ""
    content, calls = parser.finish()
    assert content == "" and len(calls) == 1, text
    if choice == "named":
        assert calls[0].function.name == "get_weather"
    parameters = {"get_weather": WEATHER, "noop": OTHER_TOOL}[calls[0].function.name]["function"][
        "parameters"
    ]
    assert jsonschema_rs.validator_for(parameters).is_valid(json.loads(calls[0].function.arguments))


def test_auto_calls_are_parsed_from_a_stream() -> None:
    parser = ToolCallParser(chat_body())
    call = '{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}'
    answer = f"Let me check. <tool_call>\n{call}\n</tool_call>"
    streamed = "".join(parser.feed(char) for char in answer)
    rest, calls = parser.finish()
    assert (streamed, rest) == ("Let me check. ", "")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"unit": "c", "days": 2})
    ]


def test_auto_text_without_a_call_is_content() -> None:
    parser = ToolCallParser(chat_body())
    streamed = parser.feed("a < b and <tool") + parser.feed("box>")
    assert streamed + parser.finish()[0] == "a < b and <toolbox>"


def test_calls_and_results_are_written_into_the_prompt(tokenizer: Tokenizer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"days": 1}'},
    }
    body = chat_body(
        messages=[
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
    )
    messages, tools = template_messages(body, tokenizer.template_supports_tools)
    text = tokenizer.apply_chat_template(messages, tools=tools)
    assert tools is None and "<tools>" in messages[0]["content"] and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"days": 1}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in text
    none_messages, _ = template_messages(chat_body(tool_choice="none"), native_tools=False)
    assert "<tools>" not in json.dumps(none_messages)


@pytest.fixture(scope="module")
def client(tokenizer: Tokenizer) -> Iterator[TestClient]:
    """The HTTP front over an engine of its own (its thread owns it)."""
    with TestClient(build_app(AsyncEngine(tiny_engine(tokenizer)), "tiny", None, None)) as test_client:
        yield test_client


def test_http_json_schema_and_forced_call(client: TestClient) -> None:
    schema = SCHEMAS["nested"]
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "JSON: "}),
    ]:
        reply = client.post(path, json={"model": "tiny", "max_tokens": 80, "response_format": fmt} | body)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        assert choice["finish_reason"] == "stop" and jsonschema_rs.validator_for(schema).is_valid(
            json.loads(text)
        )
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": "tiny", "max_tokens": 80, "messages": [{"role": "user", "content": "hi"}]}
    reply = client.post("/v1/chat/completions", json=request | {"tools": [WEATHER], "tool_choice": named})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather" and isinstance(
        json.loads(call["function"]["arguments"]), dict
    )


def test_http_streamed_tool_call(client: TestClient) -> None:
    request = {
        "model": "tiny",
        "max_tokens": 80,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
    }
    with client.stream(
        "POST", "/v1/chat/completions", json=request | {"tools": [WEATHER], "tool_choice": "required"}
    ) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [call for d in deltas for call in d.get("tool_calls") or []]
    assert len(calls) >= 1 and calls[0]["function"]["name"] == "get_weather"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all(not d.get("content") for d in deltas)


@pytest.mark.parametrize(
    ("fmt", "needle"),
    [
        (
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}},
            '"if"',
        ),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}, "nowhere"),
        ({"type": "json_schema"}, "json_schema is required"),
    ],
)
def test_http_unsupported_schema_is_a_400_naming_it(
    client: TestClient, fmt: dict[str, Any], needle: str
) -> None:
    request = {
        "model": "tiny",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": fmt,
    }
    reply = client.post("/v1/chat/completions", json=request)
    assert reply.status_code == 400 and needle in reply.json()["error"]["message"], reply.text


def test_http_tool_choice_must_name_a_tool(client: TestClient) -> None:
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    choice = {"type": "function", "function": {"name": "missing"}}
    reply = client.post("/v1/chat/completions", json=request | {"tool_choice": choice})
    assert reply.status_code == 400 and "missing" in reply.json()["error"]["message"]


def test_strict_tools_with_auto_hold_an_opened_call_to_its_schema(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    """With tool_choice auto and a strict tool, text is free until the model opens <tool_call>; the call
    inside is then held to the tools' closed schemas (an extra key or an unknown tool cannot be written)
    and free text may follow it. Without strict, nothing is enforced."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    body = chat_body(tools=[strict, OTHER_TOOL])
    assert tool_guide(chat_body()) is None

    def accepts(text: str) -> bool:
        grammar = compiler.for_guide(tool_guide(body))  # type: ignore[arg-type]
        return all(grammar.advance(token) for token in tokenizer.encode(text))

    call = '{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}'
    assert accepts(f"Let me look. <tool_call>\n{call}\n</tool_call> Done.")
    assert accepts("No call at all, just text { with braces }")
    assert not accepts('<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2, "x": 1}}')
    assert not accepts('<tool_call>\n{"name": "delete_everything", "arguments": {}}')


def test_http_strict_tools_with_auto_are_served(client: TestClient) -> None:
    """What the openai SDK's pydantic_function_tool and LangChain's bind_tools(strict=True) send: strict
    tools with tool_choice auto, once a 400, now answered under the lazy grammar above."""
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    request = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    reply = client.post("/v1/chat/completions", json=request | {"tools": [strict]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_http_chat_without_a_template_is_a_400_naming_the_ways_out() -> None:
    """A model file without tokenizer.chat_template (Gemma 3's GGUF) still serves /v1/completions; chat is
    an OpenAI-shaped 400 that says so and names --chat-template, until a template is given."""
    metadata = tiny_metadata()
    del metadata["tokenizer.chat_template"]
    chat = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(build_app(AsyncEngine(tiny_engine(Tokenizer(metadata))), "tiny", None, None)) as bare:
        reply = bare.post("/v1/chat/completions", json=chat)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "no_chat_template"
        assert error["param"] == "messages"
        for needle in ("no chat template", "/v1/completions", "--chat-template FILE"):
            assert needle in error["message"]
        completion = bare.post("/v1/completions", json={"model": "tiny", "max_tokens": 4, "prompt": "hi"})
        assert completion.status_code == 200, completion.text
    given = Tokenizer(metadata, chat_template=CHATML)  # what --chat-template FILE passes
    with TestClient(build_app(AsyncEngine(tiny_engine(given)), "tiny", None, None)) as templated:
        assert templated.post("/v1/chat/completions", json=chat).status_code == 200


def test_a_forced_calls_schema_is_closed_unless_it_says_otherwise() -> None:
    """Framework schemas (LangChain's @tool, instructor) leave additionalProperties out: closed, a model
    cannot pad keys until max_tokens; an explicit choice stays, and allOf's branches are left alone."""
    address = {"type": "object", "properties": {"street": {"type": "string"}}}
    loose = {
        "type": "object",
        "properties": {"home": address, "tags": {"type": "array", "items": address}},
        "$defs": {"Address": address},
        "anyOf": [address],
        "allOf": [address],
    }
    shut = closed(loose)
    assert (
        shut["additionalProperties"] is False and shut["properties"]["home"]["additionalProperties"] is False
    )
    assert shut["properties"]["tags"]["items"]["additionalProperties"] is False
    assert (
        shut["$defs"]["Address"]["additionalProperties"] is False
        and shut["anyOf"][0]["additionalProperties"] is False
    )
    assert "additionalProperties" not in shut["allOf"][0] and "additionalProperties" not in loose
    assert closed({"type": "object", "additionalProperties": True}) == {
        "type": "object",
        "additionalProperties": True,
    }
    body = chat_body(
        tools=[{"type": "function", "function": {"name": "f", "parameters": loose}}], tool_choice="required"
    )
    (item,) = forced_schema(body)["items"]["anyOf"]  # type: ignore[index]
    assert item["properties"]["arguments"]["additionalProperties"] is False


@pytest.mark.parametrize(
    ("choice", "text", "expected"),
    [
        ("named", '{"unit": "c", "da', [("get_weather", '{"unit": "c", "da')]),
        (
            "required",
            '[{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}, '
            '{"name": "noop", "arguments": {',
            [("get_weather", '{"unit": "c", "days": 2}'), ("noop", "{")],
        ),
        (
            "required",
            '[{"name": "get_weather", "arguments": {"unit": "f", "days": 1}}, {"name": "no',
            [("get_weather", '{"unit": "f", "days": 1}')],
        ),
        ("required", '[{"na', None),
    ],
    ids=["named", "required, second cut", "required, name cut", "nothing complete"],
)
def test_a_call_cut_by_max_tokens_is_still_a_call(
    choice: str, text: str, expected: list[tuple[str, str]] | None
) -> None:
    """OpenAI's behaviour: the partial call in tool_calls (finish_reason "length"), never in content."""
    parser = ToolCallParser(FORCED[choice])
    assert parser.feed(text) == ""
    content, calls = parser.finish(cut=True)
    if expected is None:
        assert (content, calls) == (text, [])
    else:
        assert content == "" and [(c.function.name, c.function.arguments) for c in calls] == expected
    uncut = ToolCallParser(FORCED[choice])
    uncut.feed(text)
    assert uncut.finish() == (text, [])  # not cut: text that is no call stays content


def test_http_a_named_call_cut_off_and_streamed(client: TestClient) -> None:
    """max_tokens cutting a forced call gives finish_reason "length" with the partial call in tool_calls;
    streamed, a named call's arguments arrive as deltas (the first with its id and name) that add up to
    the same arguments."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    request = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    request |= {"tools": [WEATHER], "tool_choice": named}
    choice = client.post("/v1/chat/completions", json=request).json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith("{")
    with client.stream("POST", "/v1/chat/completions", json=request | {"stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert (
        len(deltas) > 1
        and deltas[0]["id"].startswith("call_")
        and deltas[0]["function"]["name"] == "get_weather"
    )
    assert all(d["id"] is None and d["function"]["name"] is None for d in deltas[1:])
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_server_that_compiles_no_guide_never_loads_llguidance() -> None:
    """Its native library is 2.4 MiB resident: loaded with the first guide (`compiler._llguidance`), not with
    the server's modules. A fresh interpreter, so that no other test's import is seen."""
    code = (
        "import sys, kvfence.cli, kvfence.api.server, kvfence.engine.runner, kvfence.grammar.mask\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'llguidance'], 'llguidance was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


class _Continuation(Drafter):
    """Drafts the known greedy continuation, its third draft made wrong (a token the grammar may refuse)."""

    def __init__(self, paths: list[list[int]]) -> None:
        self.paths = paths

    def propose(self, request: Drafted, k: int) -> list[int]:
        tokens = request.all_token_ids
        n = len(tokens)
        path = next((p for p in self.paths if p[:n] == list(tokens)), [])
        drafts = path[n : n + k]
        return [t if i != 2 else (t + 1) % 50 for i, t in enumerate(drafts)]


def test_speculation_under_a_grammar_keeps_the_constrained_greedy_output(tokenizer: Tokenizer) -> None:
    """Each verified position is masked by the grammar as it would be after the drafts before it, and the
    matcher moves only by the tokens kept: greedy output is the same with drafts as without, and valid."""
    prompt = tokenizer.encode(PROMPT)
    greedy = SAMPLINGS["greedy"]

    def run(engine: LLMEngine) -> list[Request]:
        compiler = GrammarCompiler(tokenizer, engine.model.config.vocab_size)
        requests = [
            engine.add_request(prompt, greedy, grammar=compiler.for_schema(SCHEMAS[n])) for n in SCHEMAS
        ]
        while not all(r.is_finished for r in requests):
            engine.step()
        return requests

    plain = run(tiny_engine(tokenizer))
    engine = tiny_engine(tokenizer)
    engine.scheduler.drafter = _Continuation([prompt + r.output_token_ids for r in plain])
    engine.scheduler.num_speculative_tokens = 4
    spec = run(engine)
    assert [r.output_token_ids for r in spec] == [r.output_token_ids for r in plain]
    assert all(r.finish_reason == "stop" for r in spec)
    assert engine.spec_stats.accepted_tokens > 0 and engine.spec_stats.accepted_per_position[2] == 0


def test_chat_template_kwargs_reach_the_template_and_cannot_replace_its_inputs() -> None:
    """vLLM's `chat_template_kwargs` (Qwen 3's `enable_thinking`): further variables of the server's own
    template, rendered as HF renders them; `messages`, `tools` and the rest stay the server's."""
    thinking = CHATML.replace(
        "<|im_start|>assistant\n{% endif %}",
        "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
        "<think></think>{% endif %}{% endif %}",
    )
    tokenizer = Tokenizer({**tiny_metadata(), "tokenizer.chat_template": thinking})
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat).endswith("assistant\n")
    off = tokenizer.apply_chat_template(chat, template_kwargs={"enable_thinking": False})
    assert off.endswith("assistant\n<think></think>")
    with pytest.raises(ValueError, match="messages"):
        tokenizer.apply_chat_template(chat, template_kwargs={"messages": []})


def accepts(compiler: GrammarCompiler, guide: Guide, text: str) -> bool:
    """Whether `guide` lets the whole of `text` be written, token by token (the tiny vocab's)."""
    grammar = compiler.for_guide(guide)
    return all(grammar.advance(token) for token in TINY_TOKENIZER.encode(text))


def generate(engine: LLMEngine, compiler: GrammarCompiler, guide: Guide, seeds: int = 4) -> list[Request]:
    """The tiny model's answers under `guide`, sampled with `seeds` seeds."""
    prompt = engine.tokenizer.encode(PROMPT)  # type: ignore[union-attr]
    requests = [
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=60, temperature=1.0, seed=seed),
            grammar=compiler.for_guide(guide),
        )
        for seed in range(seeds)
    ]
    while not all(r.is_finished for r in requests):
        engine.step()
    return requests


# vLLM's docs' grammars: GBNF (llama.cpp's), a one-liner and one with rules, character classes, repetition.
YES_NO = 'root ::= "yes" | "no"'
ITEMS = 'root ::= item (", " item){0,2}\nitem ::= [a-c]+ "=" digit\ndigit ::= [0-9]\n'


def test_gbnf_grammars_are_enforced(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    yes_no, items = Guide("lark", YES_NO), Guide("lark", ITEMS)
    assert accepts(compiler, yes_no, "yes") and not accepts(compiler, yes_no, "maybe")
    assert accepts(compiler, items, "ab=1, c=2") and not accepts(compiler, items, "ab=x")
    for request in generate(engine, compiler, yes_no):
        assert (request.finish_reason, request.output_text in ("yes", "no")) == ("stop", True)
    item = re.compile(r"[a-c]+=[0-9]")
    for request in generate(engine, compiler, items):
        assert all(item.fullmatch(part) for part in request.output_text.split(", ")), request.output_text
    assert accepts(compiler, Guide("lark", 'start: "a" | "b"'), "b")  # Lark as before


@pytest.mark.parametrize(
    ("grammar", "where"),
    [
        ("root ::= [a-", "as GBNF: Unexpected end of input at line 1"),
        ("hello world", "as Lark: 1(7): Expected token ':'"),
        ("start: missing_rule", 'as Lark: at 1(8): unknown name: "missing_rule"'),
    ],
)
def test_a_grammar_in_neither_syntax_names_both_and_where_it_failed(
    compiler: GrammarCompiler, client: TestClient, grammar: str, where: str
) -> None:
    with pytest.raises(GrammarError, match="GBNF/EBNF") as error:
        compiler.for_guide(Guide("lark", grammar))
    assert "Lark (llguidance's dialect" in str(error.value) and where in str(error.value)
    for field in ({"guided_grammar": grammar}, {"structured_outputs": {"grammar": grammar}}):
        reply = client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 4} | field)
        error_body = reply.json()["error"]
        assert reply.status_code == 400 and where in error_body["message"], reply.text
        assert error_body["param"] == next(iter(field))


def test_a_regex_digit_is_an_ascii_digit(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    """Rust's \\d (llguidance's) is any Unicode digit: the tiny model wrote 🯸🯸🯸-🯸🯸🯸🯸 for \\d{3}-\\d{4}."""
    phone = Guide("regex", r"\d{3}-\d{4}")
    assert accepts(compiler, phone, "555-0123") and not accepts(compiler, phone, "🯸🯸🯸-🯸🯸🯸🯸")
    assert not accepts(compiler, phone, "٣٣٣-٣٣٣٣")  # Arabic-Indic digits
    for request in generate(engine, compiler, phone):
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", request.output_text), request.output_text
    assert accepts(compiler, Guide("regex", r"\p{Nd}{3}"), "🯸🯸🯸")  # Unicode digits, when asked for
    not_digit = Guide("regex", r"[a\D]{2}")
    assert accepts(compiler, not_digit, "ab") and not accepts(compiler, not_digit, "a1")
    pattern = Guide("json", {"type": "string", "pattern": r"^\d{2}$"})  # ECMA-262: ASCII already
    assert accepts(compiler, pattern, '"42"') and not accepts(compiler, pattern, '"🯸🯸"')


@pytest.mark.parametrize(
    ("pattern", "ascii"),
    [
        (r"\d+", "[0-9]+"),
        (r"[\d_]", "[0-9_]"),
        (r"[^\d]", "[^0-9]"),
        (r"[a\D]", "[a[^0-9]]"),
        (r"\D", "[^0-9]"),
        (r"\\d", r"\\d"),  # an escaped backslash, then the letter d
        (r"[]\d]", "[]0-9]"),  # a leading ] is a literal: the class goes on
        (r"[[:alpha:]\d]\d", "[[:alpha:]0-9][0-9]"),
        (r"\p{Nd}\x{64}", r"\p{Nd}\x{64}"),
    ],
)
def test_digit_classes_are_rewritten_only_where_they_are_digits(pattern: str, ascii: str) -> None:
    assert ascii_digits(pattern) == ascii


def test_a_lark_regex_digit_is_an_ascii_digit(engine: LLMEngine, compiler: GrammarCompiler) -> None:
    """guided_grammar's `/regex/` terminals read `\\d` as guided_regex does; a quoted `"\\\\d"` is a backslash
    and a d; GBNF has no `\\d` to read (llama.cpp's escapes), and says so."""
    digits = Guide("lark", r"start: /\d+/")
    assert accepts(compiler, digits, "123")
    assert not accepts(compiler, digits, "١٢٣") and not accepts(compiler, digits, "🯸")  # Arabic-Indic, 🯸
    for request in generate(engine, compiler, digits):
        assert re.fullmatch(r"[0-9]+", request.output_text), request.output_text
    mixed = Guide("lark", 'start: "\\\\d" NOT_DIGIT /[\\d]/i // a comment: /\\d/\nNOT_DIGIT: /\\D/')
    assert accepts(compiler, mixed, "\\dx7") and not accepts(compiler, mixed, "\\dx٣")
    assert not accepts(compiler, mixed, "\\d77") and not accepts(compiler, mixed, "1x7")
    assert accepts(compiler, Guide("lark", r"start: /\p{Nd}+/"), "١٢٣")  # Unicode digits, when asked for
    with pytest.raises(GrammarError, match=r"Invalid escape sequence \\d"):
        compiler.for_guide(Guide("lark", r"root ::= [\d]+"))


@pytest.mark.parametrize(
    ("grammar", "ascii"),
    [
        (r"start: /\d+/", "start: /[0-9]+/"),
        (r"start: /a\/\d/i", r"start: /a\/[0-9]/i"),  # an escaped slash does not end the regex
        (r"start: /\\d/", r"start: /\\d/"),  # a backslash, then the letter d
        (r'start: "\\d" /\D/', r'start: "\\d" /[^0-9]/'),  # a quoted string is no regex
        (r'start: "a/b" /\d/ "c/\"d"', r'start: "a/b" /[0-9]/ "c/\"d"'),
        ("start: /\\d/ // /\\d/\n# /\\d/", "start: /[0-9]/ // /\\d/\n# /\\d/"),  # comments
        (r"start: </s> <|im_end|> /[\d_]/", "start: </s> <|im_end|> /[0-9_]/"),  # special tokens
        (r'%json {"pattern": "^\\d/$"} /\d/', r'%json {"pattern": "^\\d/$"} /[0-9]/'),  # a schema's strings
    ],
)
def test_lark_digits_are_rewritten_only_inside_regex_terminals(grammar: str, ascii: str) -> None:
    assert lark_ascii_digits(grammar) == ascii


OPEN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 4},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}},
    },
    "required": ["name"],
}


def test_strict_closes_every_object_and_requires_every_property() -> None:
    shut = strict_schema(OPEN_SCHEMA)
    assert shut["additionalProperties"] is False and shut["required"] == ["name", "point"]
    point = shut["properties"]["point"]
    assert point["additionalProperties"] is False and point["required"] == ["x"]
    assert "additionalProperties" not in OPEN_SCHEMA and OPEN_SCHEMA["required"] == ["name"]  # a copy
    kept = strict_schema({"type": "object", "properties": {"a": {}}, "additionalProperties": True})
    assert kept["additionalProperties"] is True and kept["required"] == ["a"]
    nullable = strict_schema({"type": ["object", "null"], "properties": {"a": {}}})
    assert nullable["additionalProperties"] is False


def test_strict_response_format_gives_exactly_the_listed_keys(
    engine: LLMEngine, compiler: GrammarCompiler
) -> None:
    """Without strict the schema is taken as written (an extra key, a missing one may be written); with it,
    every answer has exactly the schema's keys at every depth: what `.parse` into a model expects."""

    def schema(strict: bool | None) -> dict[str, Any]:
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": OPEN_SCHEMA, "strict": strict}}
        return ResponseFormat.model_validate(fmt).output_schema()  # type: ignore[return-value]

    loose, tight = Guide("json", schema(None)), Guide("json", schema(True))
    assert accepts(compiler, loose, '{"name": "a", "extra": 1}') and accepts(compiler, loose, '{"name": "a"}')
    assert not accepts(compiler, tight, '{"name": "a", "extra": 1}')
    assert not accepts(compiler, tight, '{"name": "a", "point": {"x": 1, "y": 2}}')
    for request in generate(engine, compiler, tight, seeds=6):
        if request.finish_reason == "stop":
            answer = json.loads(request.output_text)
            assert set(answer) == {"name", "point"} and set(answer["point"]) == {"x"}


def test_http_strict_schemas_in_every_place_they_can_be_given(client: TestClient) -> None:
    """Chat and completions' response_format, Responses' text.format and a strict tool's parameters: an
    answer that finishes has exactly the schema's keys."""
    messages = [{"role": "user", "content": "hi"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": OPEN_SCHEMA, "strict": True}}
    text_format = {"type": "json_schema", "name": "p", "schema": OPEN_SCHEMA, "strict": True}
    tool = {"type": "function", "function": {"name": "f", "parameters": OPEN_SCHEMA, "strict": True}}
    named = {"type": "function", "function": {"name": "f"}}
    answers = []
    for seed in range(3):
        common = {"model": "tiny", "max_tokens": 60, "temperature": 1.0, "seed": seed}
        chat = common | {"messages": messages, "response_format": fmt}
        reply = client.post("/v1/chat/completions", json=chat).json()
        answers.append(reply["choices"][0]["message"]["content"])
        completion = common | {"prompt": "JSON: ", "response_format": fmt}
        answers.append(client.post("/v1/completions", json=completion).json()["choices"][0]["text"])
        call = common | {"messages": messages, "tools": [tool], "tool_choice": named}
        reply = client.post("/v1/chat/completions", json=call).json()
        answers.append(reply["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])
    response = client.post(
        "/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 60, "text": {"format": text_format}},
    )
    answers.append(response.json()["output"][0]["content"][0]["text"])
    finished = [json.loads(answer) for answer in answers if _parses(answer)]
    assert finished, answers  # some finish within max_tokens
    for answer in finished:
        assert set(answer) == {"name", "point"} and set(answer["point"]) == {"x"}, answer


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True
