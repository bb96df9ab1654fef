"""kvfence's Ray front: the ingress deployment that reads each HTTP request's body, names its tenant and
prompt text, and hands it to a server replica through a deployment handle (so that the handle's request
router, kvfence.ray.router, sees them), then streams the replica's ASGI messages back as they come.

Contracts: the front checks nothing a server checks and answers nothing itself but these errors, in
OpenAI's shape: a body over the servers' limit (413, as the server would answer it), and 503 when no server
answered before its response began (a response already begun is cut, never completed by another replica).
It reads the API key file the arguments name (owner-only, as a server does: the same `kvfence serve`
arguments) to map a key to its tenant for routing only; the server authenticates the request itself.
"""

from __future__ import annotations

import json

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from kvfence.api.auth import Auth
from kvfence.api.body_limit import DEFAULT_MAX_BODY_BYTES
from kvfence.api.errors import APIError
from kvfence.cli_checks import load_api_keys
from kvfence.ray.forward import ForwardedRequest, plain_scope, route_text
from kvfence.ray.replica import parse_replica_args

FRONT_NAME = "kvfence-front"


class _TooLarge(Exception):
    pass


class FrontApp:
    """The raw ASGI app of one front replica."""

    def __init__(self, server: DeploymentHandle, api_keys: dict[str, str] | None) -> None:
        self.server = server.options(stream=True, method_name="serve_http")
        self.auth = Auth(api_keys, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # nothing to start: the servers run their own lifespans
            await _lifespan(receive, send)
            return
        try:
            body = await _read_body(receive, DEFAULT_MAX_BODY_BYTES)
        except _TooLarge:
            await _error(send, 413, f"Request body is larger than {DEFAULT_MAX_BODY_BYTES} bytes.")
            return
        if body is None:  # the client left before its body came
            return
        request = ForwardedRequest(
            plain_scope(dict(scope)), body, self._tenant(scope), route_text(scope["path"], body)
        )
        started = False
        try:
            async for message in self.server.remote(request):
                started = started or message.get("type") == "http.response.start"
                await send(message)
        except Exception:  # Ray's errors have no common base: the replica is gone or did not take it
            if started:
                raise  # a cut stream: the client sees it end without its last event, never a mixed one
            await _error(send, 503, "No kvfence replica answered; retry.")

    def _tenant(self, scope: Scope) -> str | None:
        try:
            return self.auth.tenant(Request(scope))
        except APIError:
            return None


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _error(send: Send, status: int, message: str) -> None:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}}).encode()
    headers: list[tuple[bytes, bytes]] = [(b"content-type", b"application/json")]
    if status == 503:
        headers.append((b"retry-after", b"1"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@serve.deployment(name=FRONT_NAME)
@serve.ingress()
class KvfenceFront:
    """One front replica: reads the key file for tenants, builds nothing else."""

    def __init__(self, server: DeploymentHandle, serve_args: list[str]) -> None:
        self.server = server
        self.serve_args = [str(word) for word in serve_args]

    async def __serve_build_asgi_app__(self) -> FrontApp:
        return FrontApp(self.server, load_api_keys(parse_replica_args(self.serve_args).api_keys))
