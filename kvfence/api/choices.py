"""n > 1: several choices sampled from one prompt (the engine computes it once and forks its KV pages,
engine/engine.py), rendered as one body or one SSE stream in OpenAI's shape, each choice with its `index`.

Contracts:
- Refused before admission, with a 400 naming `n`, by an engine that does not fork.
- Each choice is rendered as an n=1 answer is (api/responses.py `ChoiceEvents`, `answer`) with its own
  logprobs formatter, tool-call parser and reasoning split (api/reasoning.py), so each has its own
  logprobs, tool calls and finish_reason, as vLLM's; a grammar (structured output, a forced tool call) holds
  every choice, each fork with its own matcher (the engine's). `prompt_logprobs`, and completions' echoed
  prompt, go with every choice.
- Usage counts the prompt once and the completion tokens of every choice, and (chat) the reasoning tokens
  of every choice, each counted by its own `ReasoningCounter`.
- An abort of any choice, or of the prompt before it forked, fails the whole answer as it would with n=1
  (invariant 8): HTTP 500 without content, or, streaming, an error event and `[DONE]` with no finish after.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from pydantic import BaseModel
from starlette.responses import JSONResponse, Response

from kvfence.api.bodies import ErrorResponse
from kvfence.api.errors import APIError, abort_error
from kvfence.api.protocol import ChatCompletionRequest, GenerationRequest
from kvfence.api.reasoning import ReasoningCounter
from kvfence.api.responses import (
    ChoiceEvents,
    EngineStreamResponse,
    Format,
    _sse,
    add_token_ids,
    answer,
    sum_usage,
)
from kvfence.api.tools import ToolCallParser
from kvfence.engine.output import RequestOutput
from kvfence.request import Status

_Outputs = AsyncGenerator[RequestOutput, None]


def check_choices(body: GenerationRequest, engine: Any) -> None:
    """APIError 400 (param `n`) when n > 1 cannot be served: see the module's contract."""
    if body.num_choices > 1 and not getattr(engine, "supports_parallel_sampling", False):
        raise APIError(400, "n > 1 is not supported by this deployment", param="n")


async def respond(
    first: RequestOutput,
    outputs: _Outputs,
    fmt: Format,
    body: GenerationRequest,
    headers: dict[str, str],
    tools: ToolCallParser | None = None,
    prompt_logprobs: Any = None,
) -> Response:
    """The answer to an admitted request with n > 1: an SSE stream or the buffered body. `tools`: the
    request's parser (each choice gets one of its own); `prompt_logprobs`: vLLM's field, rendered."""
    n = body.num_choices
    formats = [_own(fmt) for _ in range(n)]
    parsers = [_parser(body) if tools is not None else None for _ in range(n)]
    if body.stream:
        choices = [ChoiceEvents(f, p, body.include_usage) for f, p in zip(formats, parsers, strict=True)]
        events = _events(first, outputs, choices, fmt, body.include_usage, prompt_logprobs)
        return EngineStreamResponse(events, outputs, headers)
    counters = [fmt.counter() for _ in range(n)]
    finals, texts, ids = await _collect(first, outputs, formats, counters)
    used = sum_usage(finals.values(), fmt.reasoning_tokens(counters))
    bodies = [
        answer(formats[i], "".join(texts[i]), finals[i].finish_reason, used, parsers[i], prompt_logprobs)
        for i in range(n)
    ]
    if fmt.prompt_ids is not None:  # vLLM's return_token_ids: each choice's own, the prompt's once
        for i, one in enumerate(bodies):
            add_token_ids(one, fmt.prompt_ids, ids[i])
    merged = bodies[0]
    merged.choices = [_at(b, i).choices[0] for i, b in enumerate(bodies)]  # type: ignore[attr-defined]
    return JSONResponse(merged.model_dump(mode="json"), headers=headers)


def _own(fmt: Format) -> Format:
    """`fmt` for one choice: its logprobs formatter its own (the rest of a Format holds no state)."""
    return fmt if fmt.logprobs is None else dataclasses.replace(fmt, logprobs=fmt.logprobs.fork())


def _parser(body: GenerationRequest) -> ToolCallParser:
    """A choice's own tool-call parser (its own held text, and its own call ids)."""
    assert isinstance(body, ChatCompletionRequest)  # tools are chat's alone
    return ToolCallParser(body)


async def _collect(
    first: RequestOutput, outputs: _Outputs, formats: list[Format], counters: list[ReasoningCounter | None]
) -> tuple[dict[int, RequestOutput], dict[int, list[str]], dict[int, list[int]]]:
    """Every choice's text, token ids and final output, its logprobs added to its own format's and its
    tokens fed to its own reasoning count; APIError at the first abort (closing the stream then aborts the
    choices still running)."""
    finals: dict[int, RequestOutput] = {}
    texts: dict[int, list[str]] = defaultdict(list)
    ids: dict[int, list[int]] = defaultdict(list)
    output = first
    async with aclosing(outputs):
        while True:
            if output.status is Status.ABORTED:
                raise abort_error(output)
            texts[output.index].append(output.new_text)
            ids[output.index] += output.new_token_ids
            if (counter := counters[output.index]) is not None:
                counter.feed(output.new_token_ids)
            if (logprobs := formats[output.index].logprobs) is not None:
                logprobs.add(output.logprobs)
            if output.finished:
                finals[output.index] = output
                if len(finals) == len(formats):
                    return finals, texts, ids
            output = await anext(outputs)


async def _events(
    first: RequestOutput,
    outputs: AsyncIterator[RequestOutput],
    choices: list[ChoiceEvents],
    fmt: Format,
    include_usage: bool,
    prompt_logprobs: Any,
) -> AsyncIterator[str]:
    """The stream body: each choice's opening, then its chunks and finish as its outputs come, then the
    usage chunk (optional) and `[DONE]`; an abort ends it with an error event instead."""
    for index, choice in enumerate(choices):
        if (opening := choice.opening(prompt_logprobs)) is not None:
            yield _sse(_at(opening, index))
    finals: dict[int, RequestOutput] = {}
    output = first
    while True:
        if output.status is Status.ABORTED:
            yield _sse(ErrorResponse(error=abort_error(output).detail))
            break
        for chunk in choices[output.index].feed(output):
            yield _sse(_at(chunk, output.index))
        if output.finished:
            finals[output.index] = output
            if len(finals) == len(choices):
                if include_usage:
                    reasoning = fmt.reasoning_tokens(choice.counter for choice in choices)
                    yield _sse(fmt.usage_chunk(sum_usage(finals.values(), reasoning)))
                break
        output = await anext(outputs)
    yield _sse("[DONE]")


def _at(body: BaseModel, index: int) -> BaseModel:
    """`body` (a response or chunk of one choice) with that choice's index set."""
    body.choices[0].index = index  # type: ignore[attr-defined]
    return body
