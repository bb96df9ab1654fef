"""litellm and llama-index's OpenAILike against kvfence as their users point them at vLLM, on the real
SmolLM2: litellm's `hosted_vllm/` provider (and `openai/`) for chat, a streamed chat with usage, a
completion, a forced tool call, a json_schema answer, vLLM's guided_choice through `extra_body`, an
embedding and an unknown field refused as a 400 naming it; OpenAILike's chat, streamed chat and
completion. Greedy answers are compared with the server's own over plain HTTP."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import real_engine, serving
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

KEY, MODEL, HIDDEN = "sk-clients", "smollm2", 576  # SmolLM2-135M's hidden size: an embedding's length
ASK = [{"role": "user", "content": "Name a large city in France."}]
PROMPT = "The capital of France is"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CITY = {
    "type": "json_schema",
    "json_schema": {
        "name": "city",
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}


@pytest.fixture(scope="module")
def litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # its bundled map: no fetch at import
    import litellm

    return litellm


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=512))
    with serving(build_app(engine, MODEL, {KEY: "clients"}, None)) as base:
        yield base


def own(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The server's answer over plain HTTP, greedy: what each client must return."""
    headers = {"authorization": f"Bearer {KEY}"}
    answer = httpx.post(f"{url}{path}", json=body | {"model": MODEL, "temperature": 0}, headers=headers)
    assert answer.status_code == 200, answer.text
    return answer.json()


def vllm(url: str) -> dict[str, Any]:
    return {"model": f"hosted_vllm/{MODEL}", "api_base": f"{url}/v1", "api_key": KEY}


def test_litellm_chat_stream_and_completion_are_the_servers_answers(litellm: Any, url: str) -> None:
    greedy = vllm(url) | {"messages": ASK, "temperature": 0, "max_tokens": 24}
    answer = own(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 24})
    text = answer["choices"][0]["message"]
    assert litellm.completion(**greedy).choices[0].message.content == text["content"]
    chunks = list(litellm.completion(**greedy, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text["content"]
    used = [c.usage.completion_tokens for c in chunks if getattr(c, "usage", None)]
    assert used[-1] == answer["usage"]["completion_tokens"]
    via_openai = greedy | {"model": f"openai/{MODEL}"}
    assert litellm.completion(**via_openai).choices[0].message.content == text["content"]
    completion = litellm.text_completion(**vllm(url), prompt=PROMPT, max_tokens=8, temperature=0)
    assert (
        completion.choices[0].text
        == own(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8})["choices"][0]["text"]
    )


def test_litellm_tools_grammars_and_embeddings(litellm: Any, url: str) -> None:
    greedy = vllm(url) | {"messages": ASK, "temperature": 0, "max_tokens": 64}
    calls = (
        litellm.completion(**greedy, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls
    )
    assert calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)
    content = litellm.completion(**greedy, response_format=CITY).choices[0].message.content
    assert isinstance(json.loads(content)["name"], str)
    choice = litellm.completion(**greedy, extra_body={"guided_choice": ["Paris", "Lyon"]})
    assert choice.choices[0].message.content in ("Paris", "Lyon")
    vectors = litellm.embedding(**vllm(url), input=["Paris", "Lyon"]).data
    assert [len(v["embedding"]) for v in vectors] == [HIDDEN, HIDDEN]
    with pytest.raises(litellm.BadRequestError, match="best_of_everything"):
        litellm.completion(**greedy, extra_body={"best_of_everything": 3})


def test_llama_index_openai_like_chat_stream_and_completion(url: str) -> None:
    def llm(chat: bool) -> Any:
        return OpenAILike(
            model=MODEL,
            api_base=f"{url}/v1",
            api_key=KEY,
            is_chat_model=chat,
            temperature=0,
            max_tokens=24,
        )

    text = own(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 24})["choices"][0]["message"]
    messages = [ChatMessage(role="user", content=ASK[0]["content"])]
    assert llm(True).chat(messages).message.content == text["content"]
    assert "".join(r.delta or "" for r in llm(True).stream_chat(messages)) == text["content"]
    completion = own(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24})["choices"][0]["text"]
    assert llm(False).complete(PROMPT).text == completion
