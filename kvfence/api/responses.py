"""How engine outputs become OpenAI response bodies: the buffered JSON body and the SSE stream.

Contracts:
- One `Format` renders both endpoints' shapes (completions, chat), with the request id as the body's `id`.
- A stream of an aborted request ends with an SSE error event (the body of `abort_error`, so a KV integrity
  abort reads `kv_integrity_error`) then `[DONE]`, never with a normal `finish_reason` (invariant 8).
- A stream whose client goes away is closed at once, which aborts the engine request and frees its pages.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from kvfence.api.errors import abort_error
from kvfence.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    ErrorResponse,
    Usage,
)
from kvfence.engine.output import RequestOutput
from kvfence.request import Status

_Outputs = AsyncGenerator[RequestOutput, None]


@dataclass(frozen=True)
class Format:
    """How one endpoint renders a request's results: the final body, stream chunks, and the usage chunk."""

    request_id: str
    model: str
    chat: bool
    created: int

    def response(self, text: str, finish_reason: str | None, usage: Usage) -> BaseModel:
        if self.chat:
            return ChatCompletionResponse(
                id=self.request_id,
                created=self.created,
                model=self.model,
                usage=usage,
                choices=[ChatChoice(message=AssistantMessage(content=text), finish_reason=finish_reason)],
            )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            usage=usage,
            choices=[CompletionChoice(text=text, finish_reason=finish_reason)],
        )

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> BaseModel:
        if self.chat:
            delta = ChatDelta(role="assistant" if role else None, content=text)
            return ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[ChatChunkChoice(delta=delta, finish_reason=finish_reason)],
            )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=text or "", finish_reason=finish_reason)],
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        kind = ChatCompletionChunk if self.chat else CompletionResponse
        return kind(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)


def usage(output: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        total_tokens=output.prompt_tokens + output.completion_tokens,
    )


def _sse(payload: BaseModel | str) -> str:
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


async def sse_events(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput], fmt: Format, include_usage: bool
) -> AsyncIterator[str]:
    """The stream body: content deltas, then the finish (or an error event for an aborted request, and no
    normal finish_reason), the optional usage chunk, and `[DONE]`."""
    if fmt.chat:
        yield _sse(fmt.chunk("", role=True))
    output = first
    while True:
        if output.status is Status.ABORTED:
            yield _sse(ErrorResponse(error=abort_error(output).detail))
            break
        if output.new_text or output.finished:
            yield _sse(fmt.chunk(output.new_text, output.finish_reason if output.finished else None))
        if output.finished:
            if include_usage:
                yield _sse(fmt.usage_chunk(usage(output)))
            break
        output = await anext(outputs)
    yield _sse("[DONE]")


class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes the engine stream behind it: on completion, on error and
    when the client disconnects. Starlette cancels the body on disconnect but does not close a generator
    paused at `yield`, which would leave the request running until garbage collection."""

    def __init__(self, body: AsyncGenerator[str, None], outputs: _Outputs, headers: dict[str, str]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"cache-control": "no-cache", **headers}
        )
        self._body = body
        self._outputs = outputs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self._outputs.aclose()
