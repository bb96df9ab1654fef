"""The fence's aborts as their clients see them: HTTP 500 (or a stream's error event) typed
`kv_integrity_error`, as kvfence's own server answers one, never vLLM's generic InternalServerError.

vLLM ends a condemned request with FinishReason.ERROR, which its API server answers like any internal
error. So the scheduler marks the request's last output with `stop_reason` `kvfence:REASON`
(`mark_outputs`, in EngineCore's process), the API server's output processor files the request's external
id under that reason as the output passes (`FencedRequests.note`), and the serving's error check
(`FencedRequests.take`, for the id the serving knows: the external one, or the prefix of a completion's
per-prompt ids) raises `FenceAbort` (patches.py: a subclass of vLLM's GenerationError) for it instead;
`error_body` renders it. Only outputs that end in an error are marked or noted, so a request that finished
normally is never reported as fenced. The ids kept are bounded (MAX_KEPT, oldest dropped: a client that
left is never asked for).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

MARK = "kvfence:"  # the stop_reason prefix of an output the fence ended
INTEGRITY_ERROR = "kv_integrity_error"
MAX_KEPT = 4096


def mark_outputs(outputs: Iterable[Any], verdict: Mapping[str, str], error: object) -> None:
    """Mark each of `outputs` (EngineCoreOutput) of a condemned request that ends with `error`."""
    for output in outputs:
        if output.finish_reason == error and output.request_id in verdict:
            output.stop_reason = MARK + verdict[output.request_id]


def message(reason: str) -> str:
    return (
        f"The request was aborted because its KV cache failed an integrity check ({reason}); "
        "no output is returned."
    )


def error_body(text: str, type_: str, code: int) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": text, "type": type_, "param": None, "code": code}}


class FencedRequests:
    """External request id -> the fence's reason, for the requests it ended, until their serving asks."""

    def __init__(self) -> None:
        self.reasons: OrderedDict[str, str] = OrderedDict()

    def note(self, external_id: str, stop_reason: object) -> None:
        if isinstance(stop_reason, str) and stop_reason.startswith(MARK):
            self.reasons[external_id] = stop_reason[len(MARK) :]
            while len(self.reasons) > MAX_KEPT:
                self.reasons.popitem(last=False)

    def take(self, request_id: str) -> str | None:
        """Why the fence ended `request_id` (or one of its per-prompt requests), forgotten once read."""
        if request_id in self.reasons:
            return self.reasons.pop(request_id)
        for external_id in self.reasons:
            if external_id.startswith(request_id + "-"):
                return self.reasons.pop(external_id)
        return None
