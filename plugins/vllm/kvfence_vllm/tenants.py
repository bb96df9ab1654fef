"""Tenants on vLLM's HTTP front: every request's `cache_salt` comes from the tenant its API key
authenticates, so a client can never name another tenant's prefix-cache namespace (nor the fence's owner).

Keys: `KVFENCE_TENANT_KEYS=FILE` ('KEY TENANT' per line, mode 0600: kvfence's --api-keys format, read by
kvfence's own reader), else the keys vLLM was given (`--api-key K1 K2 ...`: tenant `api-key-1`, ...;
$VLLM_API_KEY: tenant `default`), else none: then nothing is authenticated here and a request's own
`cache_salt` stays its tenant, as in plain vLLM.
`TenantSalt` (ASGI middleware, outermost) answers a POST under /v1/ without a known bearer key with a 401
in OpenAI's error shape, and otherwise sets the JSON body's `cache_salt` to `kvfence:TENANT`, or
`kvfence:TENANT:SALT` where the client sent a string SALT (its own partition inside its tenant's).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

from kvfence.cli_checks import parse_api_keys
from kvfence.startup import StartupError, read_secret_file
from kvfence_vllm.settings import PluginRefused

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


def tenant_keys(api_keys: Sequence[str] | None, env: Mapping[str, str]) -> dict[str, str]:
    """Key -> tenant, from the sources above in that order; PluginRefused (one line) for a bad file."""
    path = env.get("KVFENCE_TENANT_KEYS")
    if path:
        try:
            return parse_api_keys(read_secret_file(Path(path), "KVFENCE_TENANT_KEYS"))
        except (StartupError, ValueError) as exc:
            raise PluginRefused(f"KVFENCE_TENANT_KEYS: {exc}") from None
    if api_keys:
        return {key: f"api-key-{number}" for number, key in enumerate(api_keys, 1)}
    key = env.get("VLLM_API_KEY")
    return {key: "default"} if key else {}


def salt_for(tenant: str, client_salt: object) -> object:
    """The cache_salt a tenant's request runs under; a non-string client salt is left for vLLM to refuse."""
    if client_salt is None:
        return f"kvfence:{tenant}"
    return f"kvfence:{tenant}:{client_salt}" if isinstance(client_salt, str) else client_salt


class TenantSalt:
    def __init__(self, app: ASGIApp, keys: Mapping[str, str]) -> None:
        self.app = app
        self.keys = dict(keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        tenant = self.keys.get(_bearer(scope))
        if tenant is None:
            await _unauthorized(send)
            return
        body = await _read_body(receive)
        try:
            payload = json.loads(body)
        except ValueError:
            payload = None  # not JSON: vLLM answers it (a 400), no salt to set
        if isinstance(payload, dict):
            payload["cache_salt"] = salt_for(tenant, payload.get("cache_salt"))
            body = json.dumps(payload).encode()
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
        scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay(body, receive), send)


def _bearer(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name.lower() == b"authorization":
            kind, _, key = value.decode("latin-1").partition(" ")
            return key.strip() if kind.lower() == "bearer" else ""
    return ""


async def _read_body(receive: Receive) -> bytes:
    chunks, more = [], True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, as the server reports it

    return replayed


async def _unauthorized(send: Send) -> None:
    error = {
        "message": "a known API key is required",
        "type": "authentication_error",
        "param": None,
        "code": 401,
    }
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body})
