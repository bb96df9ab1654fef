"""The OpenAI-compatible HTTP front: API key -> tenant, validation, generation, SSE, metrics, audit.

Contracts:
- The tenant comes from the API key only (invariant 7); with no key map, auth is off and every request is
  tenant "default".
- Every error body has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`.
- An aborted request never returns content with a normal finish (invariant 8): a KV integrity abort is
  HTTP 500 `kv_integrity_error` (or, once streaming, an SSE error event then `[DONE]`).
- A request id (`cmpl-…` / `chatcmpl-…`) is the response `id`, the `x-request-id` header and the key of
  the request's audit trail.
- A stream whose client goes away is closed at once, which aborts the engine request and frees its pages.
- A request body larger than `max_body_bytes` is refused with 413 before it is read whole: at once when
  Content-Length says so, else as soon as the streamed (chunked) bytes pass the limit.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Annotated, Any

import jinja2
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvfence.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ErrorDetail,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    Usage,
)
from kvfence.engine.async_engine import EngineClient
from kvfence.engine.engine import AdmissionError, RequestOutput
from kvfence.request import Status
from kvfence.trail.reasons import INTEGRITY_REASONS

_Outputs = AsyncGenerator[RequestOutput, None]
DEFAULT_MAX_TOKENS = 256
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
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
        self.detail = ErrorDetail(message=message, type=type_ or _error_type(status), param=param, code=code)
        self.headers = {"x-request-id": request_id} if request_id else {}
        if status == 503:  # every 503 here is transient (no free pages now, a worker restarting)
            self.headers["retry-after"] = "1"


def _error_type(status: int) -> str:
    return _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def _error_response(status: int, detail: ErrorDetail, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error body; text echoed from the request (a field name, a model) is made encodable first, so a
    lone surrogate in the input can never turn a 4xx into a 500 while rendering."""
    update = {"message": _encodable(detail.message), "param": _encodable(detail.param)}
    safe = detail.model_copy(update=update)
    return JSONResponse(ErrorResponse(error=safe).model_dump(), status_code=status, headers=headers)


def _encodable(text: str | None) -> str | None:
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def _abort_error(output: RequestOutput) -> APIError:
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
    return APIError(
        500, f"The request was aborted ({reason}).", "server_error", reason, request_id=output.request_id
    )


# ---- request size -------------------------------------------------------------------------------------


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
            type=_error_type(413),
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


# ---- auth ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Auth:
    api_keys: dict[str, str] | None
    admin_key: str | None

    def tenant(self, request: Request) -> str:
        """The tenant of the request's API key; 401 when the key is missing or unknown (auth on)."""
        if self.api_keys is None:
            return "default"
        key = _bearer_key(request)
        tenant = self.api_keys.get(key) if key else None
        if tenant is None:
            raise APIError(
                401, "Invalid or missing API key (send 'Authorization: Bearer KEY').", code="invalid_api_key"
            )
        return tenant

    def admin(self, request: Request) -> None:
        """Admin only: 401 without a known key, 403 for a tenant's key (and for everyone when the server
        has no admin key: the audit trail names tenants and pages, so it is never open by default)."""
        key = _bearer_key(request)
        if key and self.admin_key and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            return
        if key and self.api_keys and key in self.api_keys:
            raise APIError(403, "This endpoint needs the admin key.", code="admin_only")
        raise APIError(401, "Invalid or missing admin key.", code="invalid_api_key")


def _bearer_key(request: Request) -> str | None:
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return key.strip() or None


# Route dependencies read the app's own _Auth (module level, so FastAPI can resolve the annotations).
def _tenant(request: Request) -> str:
    return request.app.state.auth.tenant(request)


def _admin(request: Request) -> None:
    request.app.state.auth.admin(request)


Tenant = Annotated[str, Depends(_tenant)]


# ---- metrics ------------------------------------------------------------------------------------------


def _family(
    kind: type[GaugeMetricFamily | CounterMetricFamily],
    name: str,
    doc: str,
    values: dict[str, int | float],
    label: str,
) -> Metric:
    family = kind(name, doc, labels=[label])
    for key, value in values.items():
        family.add_metric([key], value)
    return family


class _EngineCollector:
    """Prometheus collector for the engine's own counters and gauges, read at scrape time."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        s = self._engine.stats()
        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield gauge(
            "kvfence_pages_free",
            "KV pages an allocation can take now (free, or cached and idle)",
            value=s.pages_free,
        )
        yield gauge("kvfence_pages_used", "KV pages held by requests", value=s.num_pages - s.pages_free)
        yield _family(gauge, "kvfence_pages", "KV pages by allocator state", s.pages_by_state, "state")
        yield counter("kvfence_prefix_cache_hits", "Pages served from the prefix cache", value=s.prefix_hits)
        yield _family(
            counter,
            "kvfence_integrity_aborts",
            "Requests aborted by the KV fence, by reason",
            s.integrity_aborts,
            "reason",
        )
        yield counter(
            "kvfence_refused_writes",
            "KV writes refused (stale generation or foreign owner)",
            value=s.refused_writes,
        )
        yield counter("kvfence_fence_checks", "Batched fence validations run", value=s.validation_checks)
        yield counter(
            "kvfence_fence_validation_seconds", "Time spent in fence validation", value=s.validation_seconds
        )


class _Metrics:
    """The app's metrics, in a registry of its own (so several apps can live in one process)."""

    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvfence_requests", "Requests by final status", ["status"], registry=r)
        self.prompt_tokens = Counter(
            "kvfence_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter("kvfence_generation_tokens", "Tokens generated", registry=r)
        self.rejections = Counter(
            "kvfence_admission_rejections", "Requests refused at admission, by reason", ["reason"], registry=r
        )
        self.ttft = Histogram(
            "kvfence_time_to_first_token_seconds",
            "Arrival to first generated token",
            registry=r,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.tpot = Histogram(
            "kvfence_time_per_output_token_seconds",
            "Mean time per token after the first",
            registry=r,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        r.register(_EngineCollector(engine))

    async def observe(self, outputs: _Outputs) -> _Outputs:
        """Pass `outputs` through, recording the request once however it ends (closing this closes
        `outputs`, which aborts the engine request)."""
        arrived, first_token_at, last, status = time.monotonic(), None, None, "aborted"
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    if first_token_at is None and output.new_token_ids:
                        first_token_at = time.monotonic()
                        self.ttft.observe(first_token_at - arrived)
                    last = output
                    if output.finished:
                        status = output.status.value
                    yield output
        except AdmissionError as exc:
            status = Status.REJECTED.value
            self.rejections.labels(exc.code).inc()
            raise
        finally:
            self._record(status, last, first_token_at)

    def _record(self, status: str, last: RequestOutput | None, first_token_at: float | None) -> None:
        self.requests.labels(status).inc()
        if last is None:
            return
        self.prompt_tokens.inc(last.prompt_tokens)
        self.generation_tokens.inc(last.completion_tokens)
        if first_token_at is not None and last.completion_tokens > 1:
            self.tpot.observe((time.monotonic() - first_token_at) / (last.completion_tokens - 1))


# ---- response shapes per endpoint ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Format:
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


def _usage(output: RequestOutput) -> Usage:
    return Usage(
        prompt_tokens=output.prompt_tokens,
        completion_tokens=output.completion_tokens,
        total_tokens=output.prompt_tokens + output.completion_tokens,
    )


def _sse(payload: BaseModel | str) -> str:
    return f"data: {payload if isinstance(payload, str) else payload.model_dump_json()}\n\n"


async def _sse_events(
    first: RequestOutput, outputs: AsyncIterator[RequestOutput], fmt: _Format, include_usage: bool
) -> AsyncIterator[str]:
    """The stream body: content deltas, then the finish (or an error event for an aborted request, and no
    normal finish_reason), the optional usage chunk, and `[DONE]`."""
    if fmt.chat:
        yield _sse(fmt.chunk("", role=True))
    output = first
    while True:
        if output.status is Status.ABORTED:
            yield _sse(ErrorResponse(error=_abort_error(output).detail))
            break
        if output.new_text or output.finished:
            yield _sse(fmt.chunk(output.new_text, output.finish_reason if output.finished else None))
        if output.finished:
            if include_usage:
                yield _sse(fmt.usage_chunk(_usage(output)))
            break
        output = await anext(outputs)
    yield _sse("[DONE]")


class _EngineStreamResponse(StreamingResponse):
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


# ---- the service --------------------------------------------------------------------------------------


class _Service:
    """Turns validated requests into engine requests and engine outputs into responses."""

    def __init__(self, engine: EngineClient, model_name: str, metrics: _Metrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.created = int(time.time())

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def models(self) -> ModelList:
        return ModelList(
            data=[ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)]
        )

    async def complete(self, body: CompletionRequest, tenant: str) -> Response:
        if isinstance(body.prompt, str):
            prompt = await run_in_threadpool(self._tokenizer().encode, body.prompt, True)
        else:
            prompt = body.prompt
            vocab = self.engine.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
        return await self._generate(body, prompt, tenant, chat=False)

    async def chat(self, body: ChatCompletionRequest, tenant: str) -> Response:
        prompt = await run_in_threadpool(self._encode_chat, body.template_messages())
        return await self._generate(body, prompt, tenant, chat=True)

    def _tokenizer(self) -> Any:
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        return tokenizer

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render with the model's chat template, then encode without adding special tokens (the template
        already wrote the ones it wants)."""
        tokenizer = self._tokenizer()
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except (jinja2.TemplateError, ValueError) as exc:
            raise APIError(400, f"cannot render the conversation: {exc}", param="messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)

    async def _generate(
        self, body: GenerationRequest, prompt: list[int], tenant: str, chat: bool
    ) -> Response:
        if body.model != self.model_name:
            raise APIError(
                404,
                f"The model '{body.model}' does not exist (this server serves '{self.model_name}').",
                code="model_not_found",
                param="model",
            )
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        params = body.sampling_params(max(1, min(DEFAULT_MAX_TOKENS, self.max_model_len - len(prompt))))
        outputs = self.metrics.observe(self.engine.generate(prompt, params, tenant, request_id))
        try:
            first = await anext(outputs)  # admission, then the first token (or an abort)
        except AdmissionError as exc:
            raise APIError(
                exc.status,
                str(exc),
                code=exc.code,
                param="messages" if chat else "prompt",
                request_id=request_id,
            ) from exc
        fmt = _Format(request_id, self.model_name, chat, int(time.time()))
        headers = {"x-request-id": request_id}
        if body.stream:
            events = _sse_events(first, outputs, fmt, body.include_usage)
            return _EngineStreamResponse(events, outputs, headers)
        async with aclosing(outputs):
            texts, last = [first.new_text], first
            async for output in outputs:
                texts.append(output.new_text)
                last = output
        if last.status is Status.ABORTED:
            raise _abort_error(last)
        body_model = fmt.response("".join(texts), last.finish_reason, _usage(last))
        return JSONResponse(body_model.model_dump(mode="json"), headers=headers)

    async def audit(self, request_id: str) -> dict[str, Any]:
        events = await run_in_threadpool(self.engine.audit_events, request_id)
        if not events:
            raise APIError(404, f"no audit trail for request '{request_id}'", code="request_not_found")
        return {"request_id": request_id, "events": events}


# ---- the app ------------------------------------------------------------------------------------------


def build_app(
    engine: EngineClient,
    model_name: str,
    api_keys: dict[str, str] | None,
    admin_key: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """The HTTP app. It owns the engine thread: `engine.start()` on startup, `engine.shutdown()` on exit.

    `api_keys` maps key -> tenant (None: auth off, every request is tenant "default"); `admin_key` opens
    the audit endpoint (None: the endpoint refuses everyone); bodies over `max_body_bytes` get a 413.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="kvfence", lifespan=lifespan)
    app.state.auth = _Auth(api_keys, admin_key)
    metrics = _Metrics(engine)
    service = _Service(engine, model_name, metrics)
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(_: Tenant) -> ModelList:
        return service.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, tenant: Tenant) -> Response:
        return await service.complete(body, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, tenant: Tenant) -> Response:
        return await service.chat(body, tenant)

    @app.get("/v1/audit/requests/{request_id}", dependencies=[Depends(_admin)])
    async def audit(request_id: str) -> dict[str, Any]:
        return await service.audit(request_id)

    @app.get("/v1/audit/info", dependencies=[Depends(_admin)])
    async def audit_info() -> dict[str, Any]:
        """What pins this service (code, model sha256, pools, window), reported by the engines."""
        return await run_in_threadpool(engine.info)

    @app.get("/metrics")
    async def scrape() -> Response:
        # Collecting waits on the engine thread: keep it off the event loop.
        text = await run_in_threadpool(generate_latest, metrics.registry)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app


def _install_error_handlers(app: FastAPI) -> None:
    """Every error, ours or the framework's, leaves in OpenAI's shape."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc.status, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        message = "; ".join(_describe_validation_error(e) for e in errors) or "invalid request"
        param = next((p for p in errors[0]["loc"][1:2] if isinstance(p, str)), None) if errors else None
        return _error_response(400, ErrorDetail(message=message, type="invalid_request_error", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = ErrorDetail(
            message=f"{request.method} {request.url.path}: {exc.detail}", type=_error_type(exc.status_code)
        )
        return _error_response(exc.status_code, detail, exc.headers)

    @app.exception_handler(Exception)
    async def crash(_: Request, exc: Exception) -> JSONResponse:
        return _error_response(
            500, ErrorDetail(message=f"internal error: {type(exc).__name__}", type="server_error")
        )


def _describe_validation_error(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error["loc"][1:])  # loc[0] is "body"
    message = str(error["msg"]).removeprefix("Value error, ")
    return f"{where}: {message}" if where else message
