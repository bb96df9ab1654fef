"""Server-sent events as OpenAI streams them: `data: {json}` lines, ended by `data: [DONE]`.

The one parser of the project's SSE clients (the audit's probe, the load generator, the benchmarks). It
imports neither torch nor the engine, so an HTTP-only client can use it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from typing import Any

DONE = "[DONE]"


class MalformedEvent(ValueError):
    """A `data:` line whose payload is not JSON (`payload` holds it)."""

    def __init__(self, payload: str) -> None:
        super().__init__(f"malformed SSE event: {payload[:80]}")
        self.payload = payload


def decode_event(line: str) -> dict[str, Any] | None:
    """The JSON object a `data:` line carries; None for any other line, for `[DONE]` and for a payload
    that is valid JSON but not an object. Raises MalformedEvent when the payload is not JSON."""
    if not line.startswith("data:"):
        return None
    payload = line.removeprefix("data:").strip()
    if payload == DONE:
        return None
    try:
        event = json.loads(payload)
    except json.JSONDecodeError:
        raise MalformedEvent(payload) from None
    return event if isinstance(event, dict) else None


def iter_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The events of a stream's lines, in order (MalformedEvent propagates)."""
    for line in lines:
        if (event := decode_event(line)) is not None:
            yield event


async def aiter_events(lines: AsyncIterable[str]) -> AsyncIterator[dict[str, Any]]:
    """`iter_events` for an async stream (httpx's `aiter_lines()`)."""
    async for line in lines:
        if (event := decode_event(line)) is not None:
            yield event
