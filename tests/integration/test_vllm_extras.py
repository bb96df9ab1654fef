"""vLLM's extra parameters and endpoints on the real SmolLM2, as a team moving from vLLM would send them:
guided_json/regex/choice/grammar and structured_outputs constrain the output; min_tokens, stop_token_ids
and include_stop_str_in_output change where it ends; every other extra works at its neutral value or is a
400 naming it, and so is a field nobody defines. /tokenize, /detokenize, /v1/models/{id} and /version
answer in vLLM's shapes behind the API keys; the `developer` role is `system`; CORS answers the allowed
origin only; /docs is off; the audit endpoints say when no admin key is configured."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import real_engine, serving

from kvfence.api.errors import UNKNOWN_PARAMETER
from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

MODEL = "smollm2-vllm"
KEY = "key-a"
ORIGIN = "https://app.example.com"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def url(smollm2: GGUFModel) -> Iterator[str]:
    engine = AsyncEngine(real_engine(smollm2, num_pages=64, max_model_len=256))
    app = build_app(engine, MODEL, {KEY: "tenant-a"}, None, allowed_origins=(ORIGIN,))
    with serving(app) as base:
        yield base


def post(url: str, path: str, body: dict[str, Any], key: str | None = KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)


def complete(url: str, **extra: Any) -> dict[str, Any]:
    response = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8} | extra)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def tokenize(url: str, text: str) -> list[int]:
    response = post(url, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def detokenize(url: str, tokens: list[int]) -> str:
    response = post(url, "/detokenize", {"tokens": tokens})
    assert response.status_code == 200, response.text
    return response.json()["prompt"]


# ---- guides ---------------------------------------------------------------------------------------------

CITY = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("extra", "valid"),
    [
        ({"guided_choice": ["Paris", "London", "a \"quoted\" city"]},
         lambda t: t in ("Paris", "London", 'a "quoted" city')),
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_json": CITY}, lambda t: set(json.loads(t)) == {"city"}),
        ({"guided_json": json.dumps(CITY)}, lambda t: set(json.loads(t)) == {"city"}),
        ({"guided_grammar": 'start: "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
        ({"structured_outputs": {"regex": "[A-Z]{4}"}}, lambda t: re.fullmatch("[A-Z]{4}", t)),
        ({"structured_outputs": {"json": CITY}}, lambda t: set(json.loads(t)) == {"city"}),
    ],
    ids=["choice", "regex", "json", "json text", "grammar", "so choice", "so regex", "so json"],
)  # fmt: skip
def test_each_guide_constrains_the_output(url: str, extra: dict[str, Any], valid: Any) -> None:
    choice = complete(url, max_tokens=24, **extra)
    assert choice["finish_reason"] == "stop" and valid(choice["text"]), choice


def test_guides_fail_closed(url: str) -> None:
    """A bad pattern or grammar is a 400 naming the parameter; two guides at once are refused, not merged."""
    for extra, param in (
        ({"guided_regex": "[unclosed"}, "guided_regex"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        # Found by the fuzz: llguidance masked bytes for it that its parser then refused mid-answer.
        ({"guided_regex": "\u001b\u009aM\nJ\u00cc\U0006eff5"}, "guided_regex"),
        ({"structured_outputs": {"regex": "(", "typo": 1}}, "structured_outputs"),
    ):
        response = post(url, "/v1/completions", {"prompt": PROMPT} | extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    both = post(url, "/v1/completions", {"prompt": PROMPT, "guided_regex": "a", "guided_choice": ["b"]})
    assert both.status_code == 400 and "only one of guided_choice, guided_regex" in both.text


# ---- where the answer ends ------------------------------------------------------------------------------


def test_min_tokens_holds_back_every_end(url: str) -> None:
    """With EOS pushed to the top by logit_bias the answer is EOS alone; min_tokens 4 holds it (and every
    other end token) back for four tokens, then EOS ends it as before."""
    eos = tokenize(url, "<|im_end|>")
    assert len(eos) == 1
    body = {"messages": QUESTION, "max_tokens": 12, "logit_bias": {str(eos[0]): 100}}
    plain = post(url, "/v1/chat/completions", body).json()
    held = post(url, "/v1/chat/completions", body | {"min_tokens": 4}).json()
    assert plain["usage"]["completion_tokens"] == 1 and plain["choices"][0]["message"]["content"] == ""
    assert held["usage"]["completion_tokens"] == 5 and held["choices"][0]["finish_reason"] == "stop"
    assert held["choices"][0]["message"]["content"]


def test_stop_token_ids_and_stop_strings_end_where_told(url: str) -> None:
    """A token id from the greedy answer ends it there, its text left out unless
    include_stop_str_in_output; so does a stop string."""
    answer = complete(url)["text"]
    ids = tokenize(url, answer)
    assert detokenize(url, ids) == answer and len(ids) >= 4  # re-tokenising the answer gives its tokens
    stopped = complete(url, stop_token_ids=[ids[2]])
    assert stopped["finish_reason"] == "stop" and stopped["text"] == detokenize(url, ids[:2])
    kept = complete(url, stop_token_ids=[ids[2]], include_stop_str_in_output=True)
    assert kept["text"] == detokenize(url, ids[:3])
    word = detokenize(url, ids[2:3])
    assert complete(url, stop=[word])["text"] == answer[: answer.index(word)]
    assert (
        complete(url, stop=[word], include_stop_str_in_output=True)["text"]
        == answer[: answer.index(word) + len(word)]
    )


# ---- the rest of the extras -----------------------------------------------------------------------------

# Each with a value that asks for behaviour this server does not have.
REFUSED = {
    "use_beam_search": True,
    "truncate_prompt_tokens": 0,  # the last N >= 1 tokens, or -1
    "allowed_token_ids": [10**9],  # outside the vocabulary
    "bad_words": [" "],  # no word
    "stop_token_ids": [10**9],
    "logits_processors": ["x"],
    "prompt_embeds": "AAAA",
    "guided_whitespace_pattern": " *",
    "request_id": "mine",
    "cache_salt": "",  # a salt is 1 to 256 characters
    "kv_transfer_params": {"do_remote_decode": True},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "priority": 5,  # no priority scheduling, as vLLM's default policy
    "length_penalty": 0.5,
}
CHAT_REFUSED = {
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable thinking": True},  # names are identifiers
    "documents": [{"title": "t", "text": "x"}],
    "echo": True,
}
# At their neutral values they change nothing (vLLM's defaults; the backend is not a behaviour, nor the
# spaces a slow HF tokenizer would put between special tokens).
NEUTRAL = {"skip_special_tokens": True, "spaces_between_special_tokens": False, "priority": 0,
           "length_penalty": 1.0, "use_beam_search": False, "guided_decoding_backend": "xgrammar",
           "min_tokens": 0, "include_stop_str_in_output": False, "stop_token_ids": [],
           "cache_salt": "tenant-a/project-x"}  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_vllm_extra_works_or_is_refused_by_name(url: str, path: str) -> None:
    body = {"messages": QUESTION} if "chat" in path else {"prompt": PROMPT}
    refused = REFUSED | (CHAT_REFUSED if "chat" in path else {})
    for name, value in refused.items():
        response = post(url, path, body | {"max_tokens": 2, name: value})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"] == name, response.text
    plain = post(url, path, body | {"max_tokens": 4}).json()["choices"][0]
    neutral = post(url, path, body | {"max_tokens": 4} | NEUTRAL)
    assert neutral.status_code == 200 and neutral.json()["choices"][0] == plain


def test_a_field_nobody_defines_is_a_400_naming_it(url: str) -> None:
    """An ignored field would answer 200 with what it did not ask for; nested objects still ignore the
    keys a client echoes back from a response (`refusal`, `annotations`)."""
    response = post(url, "/v1/chat/completions", {"messages": QUESTION, "guided_jsn": {"type": "object"}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "guided_jsn"
    assert UNKNOWN_PARAMETER in response.json()["error"]["message"]
    echoed = [*QUESTION, {"role": "assistant", "content": "Paris.", "refusal": None, "annotations": []}]
    assert post(url, "/v1/chat/completions", {"messages": echoed, "max_tokens": 2}).status_code == 200


def test_developer_role_and_generation_prompt(url: str) -> None:
    """`developer` renders as `system`; add_generation_prompt false leaves the assistant header off."""
    for role in ("system", "developer"):
        messages = [{"role": role, "content": "Answer in one word."}, *QUESTION]
        tokens = post(url, "/tokenize", {"messages": messages}).json()["tokens"]
        if role == "system":
            system = tokens
    assert tokens == system
    bare = post(url, "/tokenize", {"messages": QUESTION, "add_generation_prompt": False}).json()["tokens"]
    full = post(url, "/tokenize", {"messages": QUESTION}).json()["tokens"]
    assert full[: len(bare)] == bare and detokenize(url, full[len(bare) :]).strip() == "<|im_start|>assistant"


# ---- endpoints ------------------------------------------------------------------------------------------


def test_tokenize_and_detokenize_in_vllms_shapes(url: str) -> None:
    """The ids /tokenize gives are those the completion used (usage.prompt_tokens), chat's too; /detokenize
    reverses them; ids outside the vocabulary and another model are refused."""
    tokenized = post(url, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 256
    assert "".join(tokenized["token_strs"]).endswith(PROMPT)
    used = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1}).json()["usage"]
    assert used["prompt_tokens"] == tokenized["count"]
    chat = post(url, "/tokenize", {"messages": QUESTION}).json()
    chat_used = post(url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 1}).json()["usage"]
    assert chat_used["prompt_tokens"] == chat["count"]
    assert detokenize(url, tokenize(url, PROMPT)) == PROMPT
    assert post(url, "/detokenize", {"tokens": [10**9]}).json()["error"]["param"] == "tokens"
    assert post(url, "/tokenize", {"prompt": "x", "messages": QUESTION}).status_code == 400
    assert post(url, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404


def test_model_version_and_auth(url: str) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    card = httpx.get(f"{url}/v1/models/{MODEL}", headers=headers, timeout=10)
    assert card.status_code == 200 and card.json()["id"] == MODEL and card.json()["max_model_len"] == 256
    missing = httpx.get(f"{url}/v1/models/nope", headers=headers, timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/version", headers=headers, timeout=10).json()["version"]
    for path in ("/version", f"/v1/models/{MODEL}"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 401
    for path in ("/tokenize", "/detokenize"):
        assert post(url, path, {"prompt": "x", "tokens": [1]}, key=None).status_code == 401


def test_cors_docs_and_the_admin_hint(url: str) -> None:
    """A preflight from the allowed origin gets CORS headers (before any key is checked: browsers send none
    there); another origin gets none. /docs would load from a CDN: off. With no admin key configured the
    audit endpoints say so instead of asking for a key no one has."""
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "authorization"}
    allowed = httpx.options(f"{url}/v1/chat/completions", headers={"origin": ORIGIN} | preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(
        f"{url}/v1/chat/completions", headers={"origin": "https://evil.example"} | preflight
    )
    assert "access-control-allow-origin" not in other.headers
    answered = httpx.get(f"{url}/v1/models", headers={"origin": ORIGIN, "authorization": f"Bearer {KEY}"})
    assert answered.headers["access-control-allow-origin"] == ORIGIN
    assert httpx.get(f"{url}/docs").status_code == 404 and httpx.get(f"{url}/redoc").status_code == 404
    hint = httpx.get(f"{url}/v1/audit/info", timeout=10)
    assert hint.status_code == 403 and hint.json()["error"]["code"] == "admin_key_not_configured"
    assert "--admin-key" in hint.json()["error"]["message"]


# ---- OpenAI's Responses API -----------------------------------------------------------------------------


def responses_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_responses_answer_as_chat_does(url: str) -> None:
    """`input` and `instructions` are the chat's user and system turns: the same greedy answer, usage and
    all; streamed, the events arrive in the Responses order and their deltas spell the same text."""
    instructions = "Answer in one short sentence."
    chat = post(url, "/v1/chat/completions", {
        "messages": [{"role": "system", "content": instructions}, *QUESTION], "max_tokens": 12,
    }).json()  # fmt: skip
    client = responses_client(url)
    response = client.responses.create(
        model=MODEL, input=QUESTION[0]["content"], instructions=instructions, max_output_tokens=12
    )
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage is not None and response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    finished = chat["choices"][0]["finish_reason"]
    assert response.status == ("incomplete" if finished == "length" else "completed")
    events = list(
        client.responses.create(
            model=MODEL,
            input=QUESTION[0]["content"],
            instructions=instructions,
            max_output_tokens=12,
            stream=True,
        )
    )
    kinds = [event.type for event in events]
    opening = ["created", "in_progress", "output_item.added", "content_part.added"]
    assert kinds[:4] == [f"response.{kind}" for kind in opening]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == f"response.{response.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_formats_and_function_calls(url: str) -> None:
    """text.format json_schema is enforced; a forced function call comes back as a function_call item,
    and its output, sent back as input items, is answered."""
    client = responses_client(url)
    shaped = client.responses.create(
        model=MODEL,
        input="Describe Paris.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}},
    )
    assert set(json.loads(shaped.output_text)) == {"city"}
    tool = {"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}
    called = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=40,  # type: ignore[list-item]
    )
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    follow_up = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    answered = client.responses.create(model=MODEL, input=follow_up, max_output_tokens=8)  # type: ignore[arg-type]
    assert answered.output_text and answered.output[0].type == "message"


def test_responses_refuse_what_needs_stored_state(url: str) -> None:
    for extra, param in (
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"frobnicate": 1}, "frobnicate"),
    ):
        response = post(url, "/v1/responses", {"input": "hi"} | extra)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    stored = post(url, "/v1/responses", {"input": "hi", "store": True, "max_output_tokens": 2})
    assert stored.status_code == 400 and stored.json()["error"]["param"] == "store", stored.text
    assert "not stored" in stored.json()["error"]["message"]
    unstored = {"input": "hi", "store": False, "max_output_tokens": 2}
    assert post(url, "/v1/responses", unstored).status_code == 200


def test_chat_template_kwargs_render_with_the_servers_template(url: str) -> None:
    """Accepted as vLLM takes them: SmolLM2's template has no `enable_thinking`, so the answer is the one
    without; a name the template's own inputs hold is a 400."""
    plain = post(url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4})
    asked = {"messages": QUESTION, "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}}
    kwargs = post(url, "/v1/chat/completions", asked)
    assert kwargs.status_code == 200 and kwargs.json()["choices"][0] == plain.json()["choices"][0]
    clash = post(url, "/v1/chat/completions", asked | {"chat_template_kwargs": {"messages": []}})
    assert clash.status_code == 400 and "messages" in clash.json()["error"]["message"]
