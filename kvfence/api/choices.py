"""n > 1: several choices sampled from one prompt (the engine computes it once and forks its KV pages,
engine/engine.py), rendered as one body or one SSE stream in OpenAI's shape, each choice with its `index`.

Contracts:
- Refused before admission, with a 400 naming `n`, where it cannot be served as asked: by an engine that
  does not fork, or together with logprobs, tools or structured output (each of those keeps per-sequence
  state that a fork would have to copy).
- Usage counts the prompt once and the completion tokens of every choice.
- An abort of any choice, or of the prompt before it forked, fails the whole answer as it would with n=1
  (invariant 8): HTTP 500 without content, or, streaming, an error event and `[DONE]` with no finish after.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import aclosing
from typing import Any

from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from kvfence.api.bodies import ErrorResponse, Usage
from kvfence.api.errors import APIError, abort_error
from kvfence.api.protocol import GenerationRequest
from kvfence.api.responses import EngineStreamResponse, Format, _sse
from kvfence.engine.output import RequestOutput
from kvfence.request import Status

_Outputs = AsyncGenerator[RequestOutput, None]


def check_choices(body: GenerationRequest, engine: Any, per_sequence_state: bool) -> None:
    """APIError 400 (param `n`) when n > 1 cannot be served: see the module's contract."""
    if body.num_choices == 1:
        return
    if not getattr(engine, "supports_parallel_sampling", False):
        raise APIError(400, "n > 1 is not supported by this deployment", param="n")
    if per_sequence_state or body.logprobs_wanted() is not None or body.prompt_logprobs_wanted() is not None:
        message = "n > 1 is not supported together with logprobs, prompt_logprobs, tools or response_format"
        raise APIError(400, message, param="n")


async def respond(
    first: RequestOutput,
    outputs: _Outputs,
    fmt: Format,
    body: GenerationRequest,
    headers: dict[str, str],
) -> Response:
    """The answer to an admitted request with n > 1: an SSE stream or the buffered body."""
    n = body.num_choices
    if body.stream:
        events = _events(first, outputs, fmt, n, body.include_usage)
        return EngineStreamResponse(events, outputs, headers)
    finals, texts = await _collect(first, outputs, n)
    usage = choices_usage(finals.values())
    bodies = [fmt.response("".join(texts[i]), finals[i].finish_reason, usage) for i in range(n)]
    merged = bodies[0]
    merged.choices = [_at(b, i).choices[0] for i, b in enumerate(bodies)]  # type: ignore[attr-defined]
    return JSONResponse(merged.model_dump(mode="json"), headers=headers)


def choices_usage(finals: Iterable[RequestOutput]) -> Usage:
    finals = list(finals)
    prompt, completion = finals[0].prompt_tokens, sum(o.completion_tokens for o in finals)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def _collect(
    first: RequestOutput, outputs: _Outputs, n: int
) -> tuple[dict[int, RequestOutput], dict[int, list[str]]]:
    """Every choice's text and final output; APIError at the first abort (closing the stream then aborts
    the choices still running)."""
    finals: dict[int, RequestOutput] = {}
    texts: dict[int, list[str]] = defaultdict(list)
    output = first
    async with aclosing(outputs):
        while True:
            if output.status is Status.ABORTED:
                raise abort_error(output)
            texts[output.index].append(output.new_text)
            if output.finished:
                finals[output.index] = output
                if len(finals) == n:
                    return finals, texts
            output = await anext(outputs)


async def _events(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput], fmt: Format, n: int, include_usage: bool
) -> AsyncIterator[str]:
    """The stream body: each choice's deltas and finish as they come, then the usage chunk (optional) and
    `[DONE]`; an abort ends it with an error event instead."""
    if fmt.chat:
        for index in range(n):
            yield _sse(_at(fmt.chunk("", role=True), index))
    finals: dict[int, RequestOutput] = {}
    output = first
    while True:
        if output.status is Status.ABORTED:
            yield _sse(ErrorResponse(error=abort_error(output).detail))
            break
        if output.new_text or output.finished:
            reason = output.finish_reason if output.finished else None
            yield _sse(_at(fmt.chunk(output.new_text, reason), output.index))
        if output.finished:
            finals[output.index] = output
            if len(finals) == n:
                if include_usage:
                    yield _sse(fmt.usage_chunk(choices_usage(finals.values())))
                break
        output = await anext(outputs)
    yield _sse("[DONE]")


def _at(body: BaseModel, index: int) -> BaseModel:
    """`body` (a response or chunk of one choice) with that choice's index set."""
    body.choices[0].index = index  # type: ignore[attr-defined]
    return body
