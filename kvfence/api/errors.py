"""OpenAI-shaped errors: the exception handlers raise, and the handlers that render every failure.

Contracts:
- Every error body, ours or the framework's (validation, unknown route or method, a crash), has OpenAI's
  shape `{"error": {"message", "type", "param", "code"}}`; the type follows the status (5xx:
  `server_error`).
- Text echoed from the request (a field name, a model) is made encodable before rendering, so a lone
  surrogate in the input can never turn a 4xx into a 500.
- An engine abort is HTTP 500 and names its reason as the code; a KV integrity abort is typed
  `kv_integrity_error` (invariant 8).
- An error raised for a known request carries its `x-request-id`; every 429 and 503 carries `retry-after: 1`.
- A crash is answered with the exception's type name only, never its message.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ExceptionHandler

from kvfence.api.bodies import ErrorDetail, ErrorResponse
from kvfence.engine.output import RequestOutput
from kvfence.grammar.mask import GRAMMAR_ERROR
from kvfence.trail.reasons import INTEGRITY_REASONS

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


class APIError(Exception):
    """Raised anywhere in a handler; rendered as an OpenAI error body with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        code: str | None = None,
        param: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.detail = ErrorDetail(message=message, type=type_ or error_type(status), param=param, code=code)
        self.headers = {"x-request-id": request_id} if request_id else {}
        if status in (
            429,
            503,
        ):  # transient: a tenant's queue is full, no free pages now, a worker restarting
            self.headers["retry-after"] = "1"


def error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _error_response(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body; text echoed from the request (a field name, a model) is made encodable first, so a
    lone surrogate in the input can never turn a 4xx into a 500 while rendering."""
    update = {"message": _encodable(detail.message), "param": _encodable(detail.param)}
    safe = detail.model_copy(update=update)
    return JSONResponse(ErrorResponse(error=safe).model_dump(), status_code=status, headers=headers)


def _encodable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def abort_error(output: RequestOutput) -> APIError:
    """The error for a request the engine aborted: integrity failures are named as such (invariant 8)."""
    reason = output.finish_reason or "aborted"
    if reason in INTEGRITY_REASONS:
        return APIError(
            500,
            f"The request was aborted because its KV cache failed an integrity check "
            f"({reason}); no output is returned.",
            "kv_integrity_error",
            reason,
            request_id=output.request_id,
        )
    if reason == GRAMMAR_ERROR:
        message = "The output grammar failed during generation (grammar_error); no output is returned."
        return APIError(500, message, "server_error", reason, request_id=output.request_id)
    return APIError(
        500, f"The request was aborted ({reason}).", "server_error", reason, request_id=output.request_id
    )


def invalid_body(exc: ValidationError) -> APIError:
    """A 400 for a body its model refused: every field's complaint, the first field as `param`."""
    errors = exc.errors()
    message = "; ".join(_describe_validation_error(e) for e in errors) or "invalid request"
    param = next((p for p in errors[0]["loc"][:1] if isinstance(p, str)), None) if errors else None
    return APIError(400, message, param=param)


def exception_handlers() -> dict[Any, ExceptionHandler]:
    """The app's handlers: every error, ours or the framework's (an unknown route or method, a crash),
    leaves in OpenAI's shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return _error_response(exc.status, exc.detail, exc.headers)

    async def http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        detail = ErrorDetail(
            message=f"{request.method} {request.url.path}: {exc.detail}", type=error_type(exc.status_code)
        )
        return _error_response(exc.status_code, detail, exc.headers)

    async def crash(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            500, ErrorDetail(message=f"internal error: {type(exc).__name__}", type="server_error")
        )

    return {APIError: api_error, StarletteHTTPException: http_error, Exception: crash}


UNKNOWN_PARAMETER = "unknown parameter (neither OpenAI's nor a vLLM extra this server implements)"


def _describe_validation_error(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"])
    message = str(error["msg"]).removeprefix("Value error, ")
    if error.get("type") == "extra_forbidden":
        message = UNKNOWN_PARAMETER
    return f"{where}: {message}" if where else message
