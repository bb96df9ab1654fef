"""kvfence's Ray front and the servers' end of it, without a cluster: the front hands a server what its
router needs (the key's tenant, the prompt's text, the body whole), refuses an oversized body, streams a
server's messages back as they come and answers 503 when no server took the request; `serve_http` runs a
server's ASGI app on a forwarded request and yields its messages in order. The cluster:
tests/integration/test_ray_serve.py (its tenant-affinity test).
"""

from __future__ import annotations

import asyncio
import json
import types
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

pytest.importorskip("ray.serve")

from kvfence.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvfence.ray.deployment import KvfenceServer
from kvfence.ray.forward import ForwardedRequest
from kvfence.ray.front import FrontApp

KEYS = {"sk-a": "tenant-a", "sk-b": "tenant-b"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


class FakeServers:
    """A deployment handle's surface as the front uses it: `options(...).remote(request)`, a stream."""

    def __init__(self, messages: list[dict[str, Any]], fail_after: int | None = None) -> None:
        self.messages, self.fail_after = messages, fail_after
        self.requests: list[ForwardedRequest] = []
        self.options_given: dict[str, Any] = {}

    def options(self, **options: Any) -> FakeServers:
        self.options_given = options
        return self

    def remote(self, request: ForwardedRequest) -> AsyncIterator[dict[str, Any]]:
        self.requests.append(request)
        return self._stream()

    async def _stream(self) -> AsyncIterator[dict[str, Any]]:
        for index, message in enumerate(self.messages):
            if index == self.fail_after:
                raise RuntimeError("replica died")  # what a Ray actor error looks like to the front
            yield message


OK = [
    {"type": "http.response.start", "status": 200, "headers": [(b"x-kvfence-replica", b"r1")]},
    {"type": "http.response.body", "body": b"data: one\n\n", "more_body": True},
    {"type": "http.response.body", "body": b"data: two\n\n", "more_body": False},
]


def test_the_front_forwards_tenant_text_and_body_and_streams_back() -> None:
    servers = FakeServers(OK)
    with TestClient(FrontApp(servers, KEYS)) as client:  # type: ignore[arg-type]
        reply = client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-b"})
        client.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer sk-x"})
    assert servers.options_given == {"stream": True, "method_name": "serve_http"}
    assert (reply.status_code, reply.headers["x-kvfence-replica"]) == (200, "r1")
    assert reply.text == "data: one\n\ndata: two\n\n"
    request = servers.requests[0]
    assert request.tenant == "tenant-b" and "hello there" in request.prompt
    assert json.loads(request.body) == CHAT and request.scope["path"] == "/v1/chat/completions"
    assert (b"authorization", b"Bearer sk-b") in request.scope["headers"]  # the server authenticates
    assert set(request.scope) <= {"type", "asgi", "http_version", "method", "scheme", "path", "raw_path"} | {
        "root_path", "query_string", "headers", "client", "server"}  # fmt: skip
    assert servers.requests[1].tenant is None  # an unknown key: no tenant, so no affinity


def test_the_front_refuses_an_oversized_body_and_answers_503_for_no_replica() -> None:
    servers = FakeServers(OK, fail_after=0)
    with TestClient(FrontApp(servers, None)) as client:  # type: ignore[arg-type]
        large = client.post("/v1/completions", content=b"x" * (DEFAULT_MAX_BODY_BYTES + 1))
        gone = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert large.status_code == 413 and large.json()["error"]["type"] == "invalid_request_error"
    assert len(servers.requests) == 1  # the oversized body never reached a server
    assert servers.requests[0].tenant == "default" and servers.requests[0].prompt == "hi"  # auth off
    assert gone.status_code == 503 and gone.headers["retry-after"] == "1"
    assert gone.json()["error"]["type"] == "server_error"


def test_a_stream_cut_after_it_began_is_cut_not_completed() -> None:
    client = TestClient(FrontApp(FakeServers(OK, fail_after=2), None))  # type: ignore[arg-type]
    with client, pytest.raises(RuntimeError, match="replica died"):
        client.post("/v1/completions", json={"model": "m", "prompt": "hi"})


def test_serve_http_runs_the_servers_app_on_a_forwarded_request() -> None:
    async def echo(request: Request) -> StreamingResponse:
        body = await request.body()

        async def chunks() -> AsyncIterator[bytes]:
            yield b"got:" + body
            yield b":" + request.headers["authorization"].encode()

        return StreamingResponse(chunks(), headers={"x-seen": request.url.path})

    replica = types.SimpleNamespace(app=Starlette(routes=[Route("/v1/completions", echo, methods=["POST"])]))
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
        "headers": [(b"authorization", b"Bearer sk-a")], "client": ("127.0.0.1", 1), "server": ("h", 80),
    }  # fmt: skip
    request = ForwardedRequest(scope, b'{"prompt": "hi"}', "tenant-a", "hi")

    async def run() -> list[dict[str, Any]]:
        serve_http = KvfenceServer.func_or_class.serve_http
        return [message async for message in serve_http(replica, request)]

    messages = asyncio.run(run())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 200
    assert (b"x-seen", b"/v1/completions") in messages[0]["headers"]
    bodies = [m["body"] for m in messages[1:] if m.get("body")]
    assert bodies == [b'got:{"prompt": "hi"}', b":Bearer sk-a"]
    assert messages[-1]["type"] == "http.response.body" and not messages[-1].get("more_body", False)
