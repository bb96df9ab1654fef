"""The HTTP endpoints of the OpenAI-compatible front, each a thin call of the service (service.py) after its
check: the API keys name the tenant (auth.py), the admin key opens the audit pair, the metrics reader
/metrics; /health, /ping and /openapi.json are open.

Contracts:
- The key is checked before the body is read: a caller without one learns nothing of what it sent.
- A JSON body becomes its request model here (`read_body`): bytes that are not JSON (or nest past the
  parser's depth) and fields the model refuses are a 400 in OpenAI's shape (errors.py), the first refused
  field as `param`.
- A model answer leaves as JSON by its field aliases (`schema`, `json`), as OpenAI spells them.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvfence.api.auth import Auth
from kvfence.api.embeddings import EmbeddingRequest
from kvfence.api.endpoint import Endpoint
from kvfence.api.errors import APIError, invalid_body
from kvfence.api.openapi import openapi_document
from kvfence.api.protocol import ChatCompletionRequest, CompletionRequest
from kvfence.api.responses_api import ResponsesRequest
from kvfence.api.service import Service
from kvfence.api.tokenize import DetokenizeRequest, TokenizeRequest
from kvfence.pins import package_version

Body = TypeVar("Body", bound=BaseModel)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request's JSON body as `model`; a 400 (`APIError`) for anything else."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, or nested past the parser's depth
        raise APIError(400, f"the body is not valid JSON ({type(exc).__name__}: {exc})") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise invalid_body(exc) from None


def as_json(answer: BaseModel | dict[str, Any]) -> JSONResponse:
    return JSONResponse(
        answer.model_dump(mode="json", by_alias=True) if isinstance(answer, BaseModel) else answer
    )


def routes(service: Service, auth: Auth) -> list[Route]:
    """The endpoints: health, models, the generation endpoints, embeddings, vLLM's token endpoints, the
    admin-only audit pair, metrics, and the OpenAPI document describing them."""
    endpoints = _endpoints(service, auth)
    document: list[dict[str, Any]] = []  # built on the first ask: schema generation costs memory

    async def openapi(_: Request) -> Response:
        if not document:
            document.append(openapi_document("kvfence", package_version() or "unknown", endpoints))
        return JSONResponse(document[0])

    endpoints.append(Endpoint("/openapi.json", ("GET",), openapi))
    return [Route(e.path, e.handler, methods=list(e.methods)) for e in endpoints]


def _endpoints(service: Service, auth: Auth) -> list[Endpoint]:
    engine, metrics = service.engine, service.metrics

    async def health(request: Request) -> Response:
        """503 while the engine thread (or the router's I/O thread) is dead: nothing could be served.
        HEAD: the status alone, no body; GET adds a router's workers (up, down, or why one takes no KV)."""
        status = 200 if engine.alive else 503
        if request.method == "HEAD":
            return Response(status_code=status)
        body = {"status": "ok" if status == 200 else "dead", **engine.health()}
        return JSONResponse(body, status_code=status)

    async def ping(_: Request) -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        status = 200 if engine.alive else 503
        return JSONResponse({"status": "ok" if status == 200 else "dead"}, status_code=status)

    async def models(request: Request) -> Response:
        auth.tenant(request)
        return as_json(await service.models())

    async def model(request: Request) -> Response:
        auth.tenant(request)
        return as_json(await service.model(request.path_params["model_id"]))

    async def version(request: Request) -> Response:
        auth.tenant(request)
        return as_json({"version": package_version() or "unknown"})

    async def responses(request: Request) -> Response:
        tenant = auth.tenant(request)
        return await service.respond(await read_body(request, ResponsesRequest), tenant)

    async def embeddings(request: Request) -> Response:
        auth.tenant(request)
        return await service.embed(await read_body(request, EmbeddingRequest))

    async def tokenize(request: Request) -> Response:
        auth.tenant(request)
        return as_json(await service.tokenize(await read_body(request, TokenizeRequest)))

    async def detokenize(request: Request) -> Response:
        auth.tenant(request)
        return as_json(await service.detokenize(await read_body(request, DetokenizeRequest)))

    async def completions(request: Request) -> Response:
        tenant = auth.tenant(request)
        return await service.complete(await read_body(request, CompletionRequest), tenant)

    async def chat_completions(request: Request) -> Response:
        tenant = auth.tenant(request)
        return await service.chat(await read_body(request, ChatCompletionRequest), tenant)

    async def audit(request: Request) -> Response:
        auth.admin(request)
        return as_json(await service.audit(request.path_params["request_id"]))

    async def audit_info(request: Request) -> Response:
        """What pins this service (code, model sha256, pools, window), reported by the engines."""
        auth.admin(request)
        return as_json(await run_in_threadpool(engine.info))

    async def scrape(request: Request) -> Response:
        auth.metrics(request)
        # Collecting waits on the engine thread: keep it off the event loop.
        text = await run_in_threadpool(metrics.exposition)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return [
        Endpoint("/health", ("GET", "HEAD"), health),
        Endpoint("/ping", ("GET", "POST"), ping),
        Endpoint("/v1/models", ("GET",), models),
        Endpoint("/v1/models/{model_id}", ("GET",), model),
        Endpoint("/version", ("GET",), version),
        Endpoint("/v1/responses", ("POST",), responses, ResponsesRequest),
        Endpoint("/v1/embeddings", ("POST",), embeddings, EmbeddingRequest),
        Endpoint("/tokenize", ("POST",), tokenize, TokenizeRequest),
        Endpoint("/detokenize", ("POST",), detokenize, DetokenizeRequest),
        Endpoint("/v1/completions", ("POST",), completions, CompletionRequest),
        Endpoint("/v1/chat/completions", ("POST",), chat_completions, ChatCompletionRequest),
        Endpoint("/v1/audit/requests/{request_id}", ("GET",), audit),
        Endpoint("/v1/audit/info", ("GET",), audit_info),
        Endpoint("/metrics", ("GET",), scrape),
    ]
