"""The HTTP routes: the key is checked before a body is read, a body that is not JSON or that its model
refuses is a 400 naming the field, and /openapi.json describes each body by the model that validates it."""

from __future__ import annotations

from collections.abc import Iterator

import jsonschema_rs
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.testclient import TestClient
from test_grammar import tiny_engine, tiny_tokenizer

from kvfence.api.endpoint import Endpoint
from kvfence.api.openapi import openapi_document
from kvfence.api.protocol import CompletionRequest
from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine

KEY = {"authorization": "Bearer key-a"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = build_app(AsyncEngine(tiny_engine(tiny_tokenizer())), "tiny", {"key-a": "tenant-a"}, None)
    with TestClient(app) as test_client:
        yield test_client


def test_the_key_is_checked_before_the_body_is_read(client: TestClient) -> None:
    """Without a key, a malformed body and a refused one both get the 401: nothing is parsed for a caller
    who showed none."""
    for body in (b"{not json", b'{"model": "tiny", "prompt": "hi", "max_tokenz": 1}'):
        answer = client.post("/v1/completions", content=body)
        assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"


def test_a_body_that_is_not_json_or_is_refused_is_a_400_naming_the_field(client: TestClient) -> None:
    for body, param in [
        (b"{not json", None),
        (b"[" * 100_000, None),  # deeper than the parser goes
        (b"\xff\xfe", None),
        (b"[1, 2]", None),
        (b'{"model": "tiny", "prompt": "hi", "max_tokens": "two", "max_tokenz": 1}', "max_tokens"),
    ]:
        answer = client.post("/v1/completions", content=body, headers=KEY)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["type"] == "invalid_request_error", body[:20]
        assert error["param"] == param and error["message"]
    both = client.post("/v1/completions", content=body, headers=KEY).json()["error"]["message"]
    assert both.startswith("max_tokens: ") and "max_tokenz: unknown parameter" in both
    assert client.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["requestBody"]


async def _handler(_: Request) -> Response:
    return Response()


def test_a_body_schema_accepts_what_its_model_accepts_and_refuses_an_unknown_field() -> None:
    endpoints = [
        Endpoint("/v1/completions", ("POST",), _handler, CompletionRequest),
        Endpoint("/v1/models/{model_id}", ("GET",), _handler),
    ]
    document = openapi_document("kvfence", "0", endpoints)
    body = document["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = jsonschema_rs.validator_for({**body["schema"], "components": document["components"]})
    good = {"model": "m", "prompt": "hi", "max_tokens": 2}
    CompletionRequest.model_validate(good)
    assert schema.is_valid(good)
    assert not schema.is_valid({**good, "max_tokenz": 2})
    assert not schema.is_valid({**good, "max_tokens": "two"})
    (parameter,) = document["paths"]["/v1/models/{model_id}"]["get"]["parameters"]
    assert parameter["name"] == "model_id" and parameter["in"] == "path" and parameter["required"]
    assert "requestBody" not in document["paths"]["/v1/models/{model_id}"]["get"]
