"""The HTTP endpoints of the OpenAI-compatible front, each a thin call of the service (server.py) behind
its dependency: the API keys (`Tenant`), the admin key (audit), the metrics reader (/metrics); /health and
/ping open."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from kvfence.api.auth import Tenant, admin, metrics_reader
from kvfence.api.bodies import ModelCard, ModelList
from kvfence.api.embeddings import EmbeddingRequest
from kvfence.api.protocol import ChatCompletionRequest, CompletionRequest
from kvfence.api.responses_api import ResponsesRequest
from kvfence.api.tokenize import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from kvfence.pins import package_version

if TYPE_CHECKING:
    from kvfence.api.server import Service


def add_routes(app: FastAPI, service: Service) -> None:
    """The endpoints: health, models, the generation endpoints, embeddings, vLLM's token endpoints, the
    admin-only audit pair, metrics."""
    engine, metrics = service.engine, service.metrics

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health(request: Request) -> Response:
        """503 while the engine thread (or the router's I/O thread) is dead: nothing could be served.
        HEAD: the status alone, no body."""
        status = 200 if engine.alive else 503
        if request.method == "HEAD":
            return Response(status_code=status)
        return JSONResponse({"status": "ok" if status == 200 else "dead"}, status_code=status)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        status = 200 if engine.alive else 503
        return JSONResponse({"status": "ok" if status == 200 else "dead"}, status_code=status)

    @app.get("/v1/models")
    async def models(_: Tenant) -> ModelList:
        return await service.models()

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str, _: Tenant) -> ModelCard:
        return await service.model(model_id)

    @app.get("/version")
    async def version(_: Tenant) -> dict[str, str]:
        return {"version": package_version() or "unknown"}

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, tenant: Tenant) -> Response:
        return await service.respond(body, tenant)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, _: Tenant) -> Response:
        return await service.embed(body)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, _: Tenant) -> TokenizeResponse:
        return await service.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, _: Tenant) -> DetokenizeResponse:
        return await service.detokenize(body)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, tenant: Tenant) -> Response:
        return await service.complete(body, tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, tenant: Tenant) -> Response:
        return await service.chat(body, tenant)

    @app.get("/v1/audit/requests/{request_id}", dependencies=[Depends(admin)])
    async def audit(request_id: str) -> dict[str, Any]:
        return await service.audit(request_id)

    @app.get("/v1/audit/info", dependencies=[Depends(admin)])
    async def audit_info() -> dict[str, Any]:
        """What pins this service (code, model sha256, pools, window), reported by the engines."""
        return await run_in_threadpool(engine.info)

    @app.get("/metrics", dependencies=[Depends(metrics_reader)])
    async def scrape() -> Response:
        # Collecting waits on the engine thread: keep it off the event loop.
        text = await run_in_threadpool(metrics.exposition)
        return Response(text, media_type=CONTENT_TYPE_LATEST)
