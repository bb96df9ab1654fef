"""An HTTP request as kvfence's Ray front hands it to a server replica (kvfence.ray.front ->
KvfenceServer.serve_http), with what the request router needs to place it; free of Ray.

Why a front: Ray Serve's HTTP proxy routes a request before its body is read (a router sees only the ASGI
scope: path and headers; the replica pulls the body from the proxy afterwards), so a router cannot see the
prompt. The front, an ingress deployment, reads the body and calls the servers through a deployment handle,
whose router (kvfence.ray.router) then sees this object as the call's one argument.

Contracts:
- `plain_scope` keeps only the ASGI HTTP scope's plain fields (no proxy state, nothing callable).
- `route_text` is the text a request's prefix affinity is computed over: a chat's messages, each its role
  and its text parts, joined with separators no message text contains; a completion's prompt when it is
  one string; "" for anything else (other endpoints, bodies that are not such JSON). Turn k+1 of a chat
  begins with turn k's text, as its rendered prompt begins with turn k's tokens. Never raises. (Two chats
  whose texts join to the same string share affinity: a placement choice only, never an answer's.)
- `ForwardedRequest.prompt` is that text (the attribute Ray Serve LLM's PrefixCacheAffinityRouter reads, so
  that the benchmark compares routers on the same request); `tenant` is the tenant of the request's API key
  as the front's key map says, None when the key is unknown or missing (no affinity: the server refuses it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SCOPE_FIELDS = (
    "type",
    "asgi",
    "http_version",
    "method",
    "scheme",
    "path",
    "raw_path",
    "root_path",
    "query_string",
    "headers",
    "client",
    "server",
)
ROUTED_PATHS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
ROLE_END, MESSAGE_END = "\x1f", "\x1e"  # ASCII unit and record separators


@dataclass(frozen=True)
class ForwardedRequest:
    scope: dict[str, Any]
    body: bytes
    tenant: str | None
    prompt: str


def plain_scope(scope: dict[str, Any]) -> dict[str, Any]:
    return {name: scope[name] for name in SCOPE_FIELDS if name in scope}


def route_text(path: str, body: bytes) -> str:
    field = ROUTED_PATHS.get(path)
    if field is None:
        return ""
    try:
        request = json.loads(body)
    except (ValueError, RecursionError):
        return ""
    value = request.get(field) if isinstance(request, dict) else None
    if field == "prompt":
        return value if isinstance(value, str) else ""
    if not isinstance(value, list):
        return ""
    return "".join(_message_text(message) for message in value)


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return MESSAGE_END
    role, content = message.get("role"), message.get("content")
    if isinstance(content, list):
        content = "".join(_part_text(part) for part in content)
    text = content if isinstance(content, str) else ""
    return f"{role if isinstance(role, str) else ''}{ROLE_END}{text}{MESSAGE_END}"


def _part_text(part: Any) -> str:
    text = part.get("text") if isinstance(part, dict) else None
    return text if isinstance(text, str) else ""
