"""The request body size limit, as pure ASGI middleware in front of the app.

Contracts:
- A request body larger than `max_body_bytes` is refused with 413 before it is read whole: at once when
  Content-Length says so, else as soon as the streamed (chunked) bytes pass the limit.
- The 413 has OpenAI's error shape (code `request_too_large`) and closes the connection.
- Only HTTP requests are counted; other ASGI scopes pass through untouched.
"""

from __future__ import annotations

import json
from contextlib import suppress

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.api.bodies import ErrorDetail, ErrorResponse
from kvfence.api.errors import error_type

DEFAULT_MAX_BODY_BYTES = 8 * 2**20


class _BodyTooLarge(Exception):
    """Raised from `receive` once a request body passes the limit."""


class BodySizeLimit:
    """Pure ASGI middleware: refuse request bodies over `max_body_bytes` with 413 in OpenAI's shape.

    A declared Content-Length over the limit is answered before a single body byte is read. Otherwise the
    bytes that arrive are counted (chunked uploads declare no length) and, once past the limit, reading
    stops: whatever the app then tries to answer is replaced by the 413 (unless it already started a
    response, which our endpoints never do before reading their body)."""

    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_body_bytes < 0:
            raise ValueError("max_body_bytes must be >= 0")
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send)
            return
        await self._counted(scope, receive, send)

    async def _counted(self, scope: Scope, receive: Receive, send: Send) -> None:
        received, too_large, started = 0, False, False

        async def counting_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if too_large and not started:
                return  # the app's answer to the failed read is replaced by the 413 below
            started = started or message["type"] == "http.response.start"
            await send(message)

        with suppress(_BodyTooLarge):  # the app let the failed read escape: the 413 below answers it
            await self.app(scope, counting_receive, guarded_send)
        if too_large and not started:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        detail = ErrorDetail(
            message=f"The request body is larger than this server accepts ({self.max_body_bytes} bytes).",
            type=error_type(413),
            code="request_too_large",
        )
        body = json.dumps(ErrorResponse(error=detail).model_dump()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _content_length(scope: Scope) -> int | None:
    """The declared body length; None when absent or unreadable (the counting path then applies)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
