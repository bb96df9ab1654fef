"""Where an engine's `RequestOutput` and the wire's `Output` meet: decode sends one for each output its
engine makes, the router turns what arrives back into one for the HTTP layer, and makes its own when it
ends a request itself. Only these three cross between the two shapes."""

from __future__ import annotations

from kvfence.disagg.messages import Msg, Output
from kvfence.engine.output import RequestOutput
from kvfence.request import Status


def to_wire(output: RequestOutput, request_id: str, fork: int | None) -> Output:
    """Decode's message for `output`: a fork's under its request's id, with the fork's index."""
    return Output(
        request_id=request_id,
        token_ids=output.new_token_ids,
        text=output.new_text,
        finished=output.finished,
        status=output.status.value,
        finish_reason=output.finish_reason,
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        **Output.logprobs_fields(output.logprobs),
        fork=fork,
    )


def aborted(request_id: str, reason: str) -> Output:
    """An `output` ending the request as ABORTED, made by the router itself."""
    return Output(request_id, [], "", True, Status.ABORTED.value, reason, 0, 0)


def from_wire(message: Msg) -> RequestOutput:
    """The router's output for what decode sent (an `Output`: `accept` typed it, the router checked its
    sender and fork)."""
    assert isinstance(message, Output), f"expected an output, got {message.KIND}"
    return RequestOutput(
        message.request_id,
        message.token_ids,
        message.text,
        message.finished,
        Status(message.status),
        message.finish_reason,
        message.prompt_tokens,
        message.completion_tokens,
        message.token_logprobs(),
        message.fork or 0,
    )
