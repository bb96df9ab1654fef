"""How engine outputs become OpenAI response bodies: the buffered JSON body and the SSE stream.

Contracts:
- One `Format` renders both endpoints' shapes (completions, chat), with the request id as the body's `id`.
- A stream of an aborted request ends with an SSE error event (the body of `abort_error`, so a KV integrity
  abort reads `kv_integrity_error`) then `[DONE]`, never with a normal `finish_reason` (invariant 8).
- A stream whose client goes away is closed at once, which aborts the engine request and frees its pages.
- With a reasoning split (`Format.reasoning`, api/reasoning.py), a chat answer's reasoning goes into
  `reasoning_content` (and `reasoning`), in the message or in deltas of its own ahead of the content, and
  only the rest is content (and read for tool calls).
- Chat's usage carries `completion_tokens_details.reasoning_tokens`: the answer's tokens that were
  reasoning, counted token by token as they come (`Format.counter`, api/reasoning.py), 0 without a split;
  completions' usage has no details.
- vLLM's `return_token_ids` (`Format.prompt_ids` set): the body carries the prompt's ids (chat: on the body,
  completions: on the choice) and each choice's own; a stream the prompt's with each choice's first chunk
  and, on every chunk, the choice's ids since its chunk before (all of a choice's chunks' ids, in order,
  are its tokens).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from kvfence.api.bodies import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
    CompletionTokensDetails,
    ErrorResponse,
    ToolCallDelta,
    Usage,
)
from kvfence.api.errors import abort_error
from kvfence.api.logprobs import LogprobsFormat
from kvfence.api.protocol import ToolCall
from kvfence.api.reasoning import Reasoning, ReasoningCounter, ReasoningSplitter
from kvfence.api.tools import ToolCallParser, finish_reason, whole
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
    logprobs: LogprobsFormat | None = None  # the request asked for logprobs: each body and chunk has its own
    echo: str | None = None  # completions' `echo`: the prompt, written before the answer
    reasoning: Reasoning | None = None  # chat under --reasoning-parser: how <think> is split off
    prompt_ids: list[int] | None = None  # vLLM's `return_token_ids`: the prompt's ids (None: not asked)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole answer's (reasoning, content); no reasoning (None) without a split or a think block."""
        if self.reasoning is None:
            return None, text
        thought, content = self.reasoning.split(text)
        return thought or None, content

    def splitter(self) -> ReasoningSplitter | None:
        """A stream's split, one per choice; None without one."""
        return None if self.reasoning is None else self.reasoning.splitter()

    def counter(self) -> ReasoningCounter | None:
        """A count of one choice's reasoning tokens, fed its token ids as they come; None without a split."""
        return None if self.reasoning is None else self.reasoning.counter()

    def reasoning_tokens(self, counters: Iterable[ReasoningCounter | None]) -> int | None:
        """Usage's reasoning tokens over the choices' counts: chat's (0 without a split), None for
        completions."""
        return sum(c.tokens for c in counters if c is not None) if self.chat else None

    def _logprobs(self) -> Any:
        """The logprobs of the tokens added since the last body or chunk (None without any)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def response(
        self,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        tool_calls: list[ToolCall] | None = None,
        prompt_logprobs: Any = None,
        reasoning: str | None = None,
    ) -> BaseModel:
        """The buffered body; `prompt_logprobs`: vLLM's field, rendered (logprobs.prompt_logprobs);
        `reasoning`: the answer's think block (`split`), chat only."""
        if self.chat:
            # With calls, OpenAI's content is null unless the model also wrote text; so is it after
            # reasoning (vLLM's).
            content = (text or None) if tool_calls or reasoning else text
            message = AssistantMessage(
                content=content, tool_calls=tool_calls, reasoning_content=reasoning, reasoning=reasoning
            )
            choice = ChatChoice(
                message=message,
                finish_reason=finish_reason,
                logprobs=self._logprobs(),
                prompt_logprobs=prompt_logprobs,
            )
            return ChatCompletionResponse(
                id=self.request_id, created=self.created, model=self.model, usage=usage, choices=[choice]
            )
        completion = CompletionChoice(
            text=(self.echo or "") + text,
            finish_reason=finish_reason,
            logprobs=self._logprobs(),
            prompt_logprobs=prompt_logprobs,
        )
        return CompletionResponse(
            id=self.request_id, created=self.created, model=self.model, usage=usage, choices=[completion]
        )

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        tool_calls: list[ToolCallDelta] | None = None,
        prompt_logprobs: Any = None,
        reasoning: str | None = None,
    ) -> BaseModel:
        if self.chat:
            delta = ChatDelta(
                role="assistant" if role else None,
                content=text,
                tool_calls=tool_calls or None,
                reasoning_content=reasoning,
                reasoning=reasoning,
            )
            return ChatCompletionChunk(
                id=self.request_id,
                created=self.created,
                model=self.model,
                choices=[
                    ChatChunkChoice(
                        delta=delta,
                        finish_reason=finish_reason,
                        logprobs=self._logprobs(),
                        prompt_logprobs=prompt_logprobs,
                    )
                ],
            )
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[
                CompletionChoice(
                    text=text or "",
                    finish_reason=finish_reason,
                    logprobs=self._logprobs(),
                    prompt_logprobs=prompt_logprobs,
                )
            ],
        )

    def usage_chunk(self, usage: Usage) -> BaseModel:
        kind = ChatCompletionChunk if self.chat else CompletionResponse
        return kind(id=self.request_id, created=self.created, model=self.model, choices=[], usage=usage)


def usage(output: RequestOutput, reasoning_tokens: int | None = None) -> Usage:
    """One answer's usage; `reasoning_tokens` (`Format.reasoning_tokens`): chat's details, None: none."""
    return sum_usage([output], reasoning_tokens)


def sum_usage(finals: Iterable[RequestOutput], reasoning_tokens: int | None = None) -> Usage:
    """The usage of the choices of one prompt (their final outputs): the prompt once, every completion."""
    finals = list(finals)
    prompt, completion = finals[0].prompt_tokens, sum(o.completion_tokens for o in finals)
    details = None if reasoning_tokens is None else CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        completion_tokens_details=details,
    )


def add_token_ids(body: Any, prompt: list[int] | None, tokens: list[int]) -> None:
    """vLLM's `return_token_ids` on a one-choice body or chunk: the choice's `tokens` and, unless None, the
    prompt's ids (chat: on the body, completions: on the choice)."""
    choice = body.choices[0]
    choice.token_ids = tokens
    if prompt is None:
        return
    if isinstance(choice, CompletionChoice):
        choice.prompt_token_ids = prompt
    else:
        body.prompt_token_ids = prompt


def _sse(payload: BaseModel | str) -> str:
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


async def sse_events(
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    fmt: Format,
    include_usage: bool,
    tools: ToolCallParser | None = None,
    prompt_logprobs: Any = None,
) -> AsyncIterator[str]:
    """The stream body: content deltas, then the finish (or an error event for an aborted request, and no
    normal finish_reason), the optional usage chunk, and `[DONE]`. The chunks are `ChoiceEvents`'."""
    choice = ChoiceEvents(fmt, tools, count=include_usage)
    if (opening := choice.opening(prompt_logprobs)) is not None:
        yield _sse(opening)
    output = first
    while True:
        if output.status is Status.ABORTED:
            yield _sse(ErrorResponse(error=abort_error(output).detail))
            break
        for chunk in choice.feed(output):
            yield _sse(chunk)
        if output.finished:
            if include_usage:
                yield _sse(fmt.usage_chunk(usage(output, fmt.reasoning_tokens([choice.counter]))))
            break
        output = await anext(outputs)
    yield _sse("[DONE]")


class ChoiceEvents:
    """One choice's stream chunks, output by output, with its own reasoning split, tool-call parser and
    logprobs (`fmt.logprobs`): n > 1 has one of these per choice.

    With `tools`, a named call streams its arguments; other text that may be a tool call is held back and
    sent at the end as one `tool_calls` delta, with finish_reason "tool_calls" ("length" when max_tokens cut
    the last call). An echoed prompt (completions) goes first, in a chunk of its own; `prompt_logprobs`
    (vLLM's) with the first chunk. With a reasoning split, reasoning goes out in deltas of its own, before
    the content, and (`count`: a usage chunk will tell) `counter` counts its tokens."""

    def __init__(self, fmt: Format, tools: ToolCallParser | None = None, count: bool = True) -> None:
        self.fmt, self.tools, self.splitter = fmt, tools, fmt.splitter()
        # Without a usage chunk nothing reads the count: no token is decoded a second time for it.
        self.counter = fmt.counter() if count else None
        # `return_token_ids`: the ids not yet on a chunk (text held back keeps its ids back too), and the
        # prompt's until the first chunk carries them.
        self._ids: list[int] | None = None if fmt.prompt_ids is None else []
        self._prompt_ids = fmt.prompt_ids

    def opening(self, prompt_logprobs: Any = None) -> BaseModel | None:
        """The chunk before any output: chat's role, completions' echoed prompt; None when there is none."""
        if self.fmt.chat:
            return self._with_ids([self.fmt.chunk("", role=True, prompt_logprobs=prompt_logprobs)])[0]
        if self.fmt.echo is not None or prompt_logprobs is not None:
            return self._with_ids([self.fmt.chunk(self.fmt.echo or "", prompt_logprobs=prompt_logprobs)])[0]
        return None

    def feed(self, output: RequestOutput) -> list[BaseModel]:
        """The chunks one output of this choice (not an abort) makes; with its last, the finish."""
        if self._ids is not None:
            self._ids += output.new_token_ids
        return self._with_ids(self._chunks(output))

    def _with_ids(self, chunks: list[BaseModel]) -> list[BaseModel]:
        """`return_token_ids`: the ids not yet sent (and the prompt's, the first time) on the first chunk,
        none on the rest."""
        if self._ids is None or not chunks:
            return chunks
        add_token_ids(chunks[0], self._prompt_ids, self._ids)
        for chunk in chunks[1:]:
            add_token_ids(chunk, None, [])
        self._ids, self._prompt_ids = [], None
        return chunks

    def _chunks(self, output: RequestOutput) -> list[BaseModel]:
        fmt, tools, chunks = self.fmt, self.tools, []
        if fmt.logprobs is not None:
            fmt.logprobs.add(output.logprobs)  # sent with the next chunk that goes out
        thought, text = "", output.new_text
        if self.counter is not None:
            self.counter.feed(output.new_token_ids)
        if self.splitter is not None:
            thought, text = self.splitter.feed(output.new_text, final=output.finished)
        if thought:
            chunks.append(fmt.chunk(None, reasoning=thought))
        text = text if tools is None else tools.feed(text)
        calls: list[ToolCall] = []
        if tools is not None and (delta := tools.arguments_delta()) is not None:
            chunks.append(fmt.chunk(None, tool_calls=[delta]))  # a named call, as its arguments are written
        if output.finished and tools is not None:
            rest, calls = tools.finish(cut=output.finish_reason == "length")
            text += rest
        if calls and tools is not None and tools.mode != "named":
            chunks.append(fmt.chunk(text or None, tool_calls=whole(calls)))
        if (text and not calls) or output.finished:
            reason = finish_reason(output.finish_reason, calls) if output.finished else None
            chunks.append(fmt.chunk(None if calls else text, reason))
        return chunks


def answer(
    fmt: Format,
    text: str,
    reason: str | None,
    used: Usage,
    tools: ToolCallParser | None = None,
    prompt_logprobs: Any = None,
) -> BaseModel:
    """The buffered body of one choice's whole `text`, which the engine ended for `reason`: its reasoning
    split off, then (with `tools`) its tool calls parsed out of the rest, its logprobs `fmt.logprobs`'."""
    (thought, text), calls = fmt.split(text), []
    if tools is not None:
        streamed = tools.feed(text)
        rest, calls = tools.finish(cut=reason == "length")
        text = streamed + rest
    return fmt.response(text, finish_reason(reason, calls), used, calls or None, prompt_logprobs, thought)


class EngineStreamResponse(StreamingResponse):
    """A StreamingResponse that always closes the engine stream behind it: on completion, on error and
    when the client disconnects. Starlette cancels the body on disconnect but does not close a generator
    paused at `yield`, which would leave the request running until garbage collection."""

    def __init__(self, body: AsyncGenerator[str, None], outputs: _Outputs, headers: dict[str, str]) -> None:
        super().__init__(
            body, media_type="text/event-stream", headers={"cache-control": "no-cache", **headers}
        )
        self._body = body
        self.outputs = outputs  # the engine stream behind the body (a relay of this body closes it too)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()
            await self.outputs.aclose()
