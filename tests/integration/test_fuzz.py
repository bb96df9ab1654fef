"""Bad input: schemathesis fuzzes the server's own OpenAPI document, then explicit malformed requests.

The server is the real SmolLM2 behind uvicorn with a 64-token window, so every accepted request generates
at most a few dozen tokens and anything bigger is refused at once. Rules for every answer: no 5xx except
`kv_integrity_error`; every 4xx in OpenAI's error shape. tests/integration/test_server.py already covers
malformed JSON on chat, unknown models, token ids out of range, n and top_logprobs on chat and
max_tokens=0 (tests/integration/test_sampling_api.py the range of every sampling value); this file adds the
rest of the list, and the request-size limit (413 before the body is read whole).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from conftest import real_engine
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from kvfence.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.sse import iter_events
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model

MODEL = "smollm2-fuzz"
KEY = "fuzz-key"
AUTH = {"authorization": f"Bearer {KEY}"}
WINDOW = 64
EXAMPLES = 25  # per operation and generation mode: the whole fuzz stays well under a minute
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(smollm2: GGUFModel) -> Iterator[Cluster]:
    engine = real_engine(smollm2, num_pages=8, max_model_len=WINDOW)
    with cluster(engine, api_keys={KEY: "tenant-fuzz"}, admin_key="fuzz-admin", model_name=MODEL) as running:
        yield running


def assert_openai_answer(status: int, content: bytes) -> None:
    """No 5xx but kv_integrity_error; every 4xx and 5xx body is `{"error": {message, type, param, code}}`;
    in a 200 event stream, an error event obeys the same rules."""
    if status < 400:
        for event in _sse_errors(content):
            assert_openai_error(event, server_side=True)
        return
    assert_openai_error(json.loads(content), server_side=status >= 500)


def assert_openai_error(body: dict[str, Any], server_side: bool) -> None:
    assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    if server_side:
        assert body["error"]["type"] == "kv_integrity_error", body


def _sse_errors(content: bytes) -> list[dict[str, Any]]:
    return [event for event in iter_events(content.decode(errors="replace").splitlines()) if "error" in event]


POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
FUZZ = [
    ("POST /v1/completions", POSITIVE),
    ("POST /v1/completions", NEGATIVE),
    ("POST /v1/chat/completions", POSITIVE),
    ("POST /v1/chat/completions", NEGATIVE),
    ("GET /v1/models", POSITIVE),  # no parameters: nothing to make negative
    ("GET /health", POSITIVE),
]


@pytest.mark.parametrize(("label", "mode"), FUZZ, ids=[f"{label} {mode}" for label, mode in FUZZ])
def test_fuzz_the_openapi_document(server: Cluster, label: str, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operation = schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is not in the server's OpenAPI document"

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: Any) -> None:
        if mode is POSITIVE and isinstance(case.body, dict):
            case.body["model"] = MODEL  # a random model name is a 404 before anything else is looked at
        response = case.call(base_url=server.url, headers=AUTH, timeout=60)
        assert_openai_answer(response.status_code, response.content)

    fuzz()


# ---- explicit bad requests -----------------------------------------------------------------------------


def post(server: Cluster, path: str, **kwargs: Any) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.url}{path}", headers=headers, timeout=60, **kwargs)


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "Hello", "max_tokens": 2, **fields}


BAD_BODIES = {
    "truncated JSON": b'{"model": "smollm2-fuzz", "prompt": "Hi"',
    "JSON array": b"[1, 2, 3]",
    "not JSON": b"prompt=Hi&max_tokens=2",
    "non-UTF-8 bytes": b'{"model": "smollm2-fuzz", "prompt": "\xff\xfe\xfd"}',
    "lone surrogate": b'{"model": "smollm2-fuzz", "prompt": "\\ud800 hi", "max_tokens": 2}',
    "lone surrogate in model": b'{"model": "\\udfff", "prompt": "hi", "max_tokens": 2}',
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
def test_malformed_bodies_are_400(server: Cluster, body: bytes) -> None:
    response = post(server, "/v1/completions", content=body)
    assert response.status_code == 400, response.text
    assert_openai_answer(response.status_code, response.content)
    assert response.json()["error"]["type"] == "invalid_request_error"


BAD_FIELDS = {
    "max_tokens string": {"max_tokens": "ten"},
    "max_tokens float": {"max_tokens": 2.5},
    "max_tokens negative": {"max_tokens": -1},
    "temperature string": {"temperature": "hot"},
    "prompt object": {"prompt": {"text": "hi"}},
    "prompt null": {"prompt": None},
    "stop number": {"stop": 7},
    "stream object": {"stream": {"yes": True}},
    "n=17": {"n": 17},
    "logprobs=21": {"logprobs": 21},
    "logprobs=-1": {"logprobs": -1},
    "best_of=2": {"best_of": 2},
    "echo": {"echo": {"on": 1}},
    "suffix": {"suffix": "!"},
    "logit_bias": {"logit_bias": {"42": 500}},
    "presence_penalty": {"presence_penalty": 2.5},
    "frequency_penalty": {"frequency_penalty": -3},
}


@pytest.mark.parametrize("fields", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_wrong_types_and_unsupported_options_are_400(server: Cluster, fields: dict[str, Any]) -> None:
    response = post(server, "/v1/completions", json=completion(**fields))
    assert response.status_code == 400, response.text
    assert_openai_answer(response.status_code, response.content)
    assert response.json()["error"]["param"] == next(iter(fields))


def test_neutral_values_of_unsupported_options_are_accepted(server: Cluster) -> None:
    neutral = {"n": 1, "best_of": 1, "echo": False, "logit_bias": {}, "presence_penalty": 0, "suffix": ""}
    assert post(server, "/v1/completions", json=completion(**neutral)).status_code == 200


@pytest.mark.parametrize(
    "fields",
    [{"prompt": ""}, {"prompt": []}],
    ids=["empty text", "no token ids"],
)
def test_empty_prompts_are_400(server: Cluster, fields: dict[str, Any]) -> None:
    response = post(server, "/v1/completions", json=completion(**fields))
    assert response.status_code == 400 and response.json()["error"]["code"] == "empty_prompt"


def test_empty_chat_is_400(server: Cluster) -> None:
    response = post(server, "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize(
    "fields",
    [
        {"max_tokens": 10**6},
        {"max_tokens": 10**30},
        {"prompt": "lorem ipsum " * 100_000},  # 1.2 MB of text
        {"prompt": [42] * 100_000},
    ],
    ids=["max_tokens 1e6", "max_tokens 1e30", "1 MB prompt", "100k token ids"],
)
def test_huge_requests_are_refused_before_any_page(server: Cluster, fields: dict[str, Any]) -> None:
    response = post(server, "/v1/completions", json=completion(**fields))
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    "fields", [{"temperature": 1e-40}, {"top_p": 5e-324}], ids=["temperature 1e-40", "top_p 5e-324"]
)
def test_vanishing_temperature_or_top_p_is_greedy_not_a_crash(
    server: Cluster, fields: dict[str, Any]
) -> None:
    """logits / 1e-40 overflow float32, and a top_p below float32's range drops every token: such values
    sample greedily (their limit) instead of failing the step, and with it every request in the batch."""
    greedy = post(server, "/v1/completions", json=completion(max_tokens=6, temperature=0))
    tiny = post(server, "/v1/completions", json=completion(max_tokens=6, **fields))
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


# ---- request size ----------------------------------------------------------------------------------------


def raw_exchange(server: Cluster, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a raw HTTP/1.1 request (headers, then body parts, never the end of a chunked body) and return
    whatever the server answers within 10 s."""
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def assert_413(answer: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head[:100]
    error = json.loads(body)["error"]
    assert set(error) == ERROR_FIELDS and error["code"] == "request_too_large"


def test_declared_oversized_body_is_refused_before_it_is_sent(server: Cluster) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {KEY}\r\ncontent-length: {DEFAULT_MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    )
    assert_413(raw_exchange(server, head, [b'{"model": "']))  # 11 of 8 MiB + 1 bytes ever sent


def test_chunked_oversized_body_is_refused_while_streaming(server: Cluster) -> None:
    """No Content-Length: the bytes are counted as they arrive; the 413 comes although the body never
    ends (its terminating chunk is never sent)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {KEY}\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    )
    chunk = 2**20
    parts = [
        f"{chunk:x}\r\n".encode() + b" " * chunk + b"\r\n" for _ in range(DEFAULT_MAX_BODY_BYTES // chunk + 1)
    ]
    assert_413(raw_exchange(server, head, parts))


def test_a_body_under_the_limit_still_works(server: Cluster) -> None:
    padded = json.dumps(completion()) + " " * (DEFAULT_MAX_BODY_BYTES // 2)
    assert post(server, "/v1/completions", content=padded.encode()).status_code == 200
