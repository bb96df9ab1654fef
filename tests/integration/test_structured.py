"""Structured output and a forced tool call on the real SmolLM2, through the HTTP API and the official
`openai` client: the answers parse and validate against their schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator

import instructor
import jsonschema_rs
import openai
import pytest
from conftest import real_engine, serving
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

MODEL = "smollm2-test"
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "continent": {"enum": ["Africa", "Asia", "Europe", "America", "Oceania"]},
        "is_capital": {"type": "boolean"},
    },
    "required": ["city", "continent", "is_capital"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 40},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def client(smollm2: GGUFModel) -> Iterator[openai.OpenAI]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=1024))
    with serving(build_app(engine, MODEL, None, None)) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_json_schema(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert jsonschema_rs.validator_for(CITY).is_valid(json.loads(choice.message.content or ""))


def test_forced_tool_call(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        max_tokens=60,
        temperature=0,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"  # type: ignore[union-attr]
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    assert jsonschema_rs.validator_for(WEATHER["function"]["parameters"]).is_valid(arguments)  # type: ignore[index]


# ---- frameworks: what LangChain and instructor send --------------------------------------------------------


class City(BaseModel):
    """A city and the country it is in."""

    name: str
    country: str


def test_langchain_named_tool_and_strict_structured_output(client: openai.OpenAI) -> None:
    """LangChain's schemas leave additionalProperties out; the forced call's schema is closed, so the model
    cannot pad extra keys until max_tokens and the call comes back as a call: `bind_tools` naming the tool,
    and `with_structured_output(method="function_calling", strict=True)` (a strict tool, forced)."""

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city, in celsius or fahrenheit."""
        return f"sunny in {city}"

    llm = ChatOpenAI(
        base_url=str(client.base_url),
        api_key="unused",
        model=MODEL,
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) <= {"city", "unit"} and call["args"], reply
    city = llm.with_structured_output(City, method="function_calling", strict=True).invoke(
        "Paris is a city in France. Extract the city."
    )
    assert isinstance(city, City) and city.name and city.country


def test_instructor_tools_and_partial_streaming(client: openai.OpenAI) -> None:
    """instructor (pinned) in its TOOLS mode: the response model comes back validated, and streamed as
    partials that grow with the call's argument deltas (many partials, not one) to a whole object (the
    partial model's schema makes every field optional: its call may differ from the whole model's)."""
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    ask = [{"role": "user", "content": "Paris is a city in France. Extract the city."}]
    city = patched.chat.completions.create(
        model=MODEL, messages=ask, response_model=City, max_tokens=60, temperature=0, max_retries=0
    )
    assert isinstance(city, City) and city.name and city.country
    partials = list(
        patched.chat.completions.create_partial(
            model=MODEL, messages=ask, response_model=City, max_tokens=60, temperature=0, max_retries=0
        )
    )
    assert len(partials) > 3, partials
    last = City.model_validate(partials[-1].model_dump())
    assert last.name and last.country


class Trip(BaseModel):
    city: str
    nights: int
    budget: str | None = None  # optional in the model: `.parse`'s strict schema still requires it


def test_parse_into_a_model_and_strict_closes_an_open_schema(client: openai.OpenAI) -> None:
    """The client's `.parse` (its strict schema) gives a parsed model; a strict schema that leaves its
    objects open and its keys optional (as LangChain's) is closed by the server: exactly its keys."""
    messages = [{"role": "user", "content": "Plan a trip to Rome."}]
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages, response_format=Trip, max_tokens=80
    )
    choice = parsed.choices[0]
    assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Trip)
    open_schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": open_schema, "strict": True}}
    reply = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        response_format=fmt,
        max_tokens=80,  # type: ignore[arg-type]
    )
    assert set(json.loads(reply.choices[0].message.content or "")) == {"city", "days"}
