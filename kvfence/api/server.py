"""The OpenAI-compatible HTTP front: the Starlette app around the service (service.py).

The other jobs live beside it: service.py (requests into engine generations, outputs into responses),
routes.py (the endpoints, each a call of the service), auth.py (API key -> tenant, the admin key),
body_limit.py (413 before a large body is read), errors.py (OpenAI-shaped errors), responses.py (JSON bodies
and SSE streams), metrics.py (Prometheus), protocol.py (the request and response models), tokenize.py
(vLLM's token endpoints), responses_api.py (OpenAI's /v1/responses over chat), embeddings.py (OpenAI's
/v1/embeddings) and stats_log.py (vLLM's periodic stats line, the per-request log).

Contracts:
- /v1/embeddings, /tokenize, /detokenize, /version and /v1/models/{id} sit behind the API keys like
  generation; the audit endpoints behind the admin key; no /docs (a CDN's scripts); CORS only for
  `allowed_origins`.
- /health (GET, and HEAD without a body) and vLLM's /ping (GET, POST) are open: 200, or 503 while the
  engine thread is dead.
- The app owns the engine thread: `engine.start()` on startup, `engine.shutdown()` on exit.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from kvfence.api.auth import Auth
from kvfence.api.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit
from kvfence.api.errors import exception_handlers
from kvfence.api.metrics import Metrics
from kvfence.api.routes import routes
from kvfence.api.service import Service
from kvfence.api.stats_log import RequestLog, StatsLogger
from kvfence.engine.async_engine import EngineClient
from kvfence.sampling import SamplingDefaults


def build_app(
    engine: EngineClient,
    model_name: str,
    api_keys: dict[str, str] | None,
    admin_key: str | None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    sampling: SamplingDefaults | None = None,
    allowed_origins: tuple[str, ...] = (),
    metrics_compat: str | None = None,
    reasoning_parser: str | None = None,
    stats_interval_s: float | None = None,
    request_log: RequestLog | None = None,
) -> Starlette:
    """The HTTP app. It owns the engine thread: `engine.start()` on startup, `engine.shutdown()` on exit.

    `api_keys` maps key -> tenant (None: auth off, every request is tenant "default"); `admin_key` opens
    the audit endpoint (None: the endpoint refuses everyone); bodies over `max_body_bytes` get a 413.
    `sampling`: what a request that leaves a sampling value out gets (None: `SamplingDefaults()`, greedy).
    `allowed_origins`: browser origins answered with CORS headers (none: no CORS). No /docs or /redoc:
    they load their scripts from a CDN, blank on a machine without one. `metrics_compat` "vllm": /metrics
    repeats vLLM's series under vLLM's names (api/metrics.py). `reasoning_parser`: vLLM's, a chat
    answer's think block split off into `reasoning_content` (api/reasoning.py; ValueError for an unknown one).
    `stats_interval_s`: vLLM's stats line every so many seconds while serving (None: none);
    `request_log`: a line per request at arrival and end (api/stats_log.py).
    """

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        engine.start()
        ticks = None
        if stats_interval_s is not None:
            ticks = asyncio.create_task(StatsLogger(engine.stats).run(stats_interval_s))
        try:
            yield
        finally:
            if ticks is not None:
                ticks.cancel()
            engine.shutdown()

    metrics = Metrics(engine, model_name, engine.max_model_len, metrics_compat)
    service = Service(engine, model_name, metrics, sampling or SamplingDefaults(), reasoning_parser)
    service.request_log = request_log
    middleware = [Middleware(BodySizeLimit, max_body_bytes=max_body_bytes)]
    if allowed_origins:  # outermost: a preflight is answered before any other check
        cors = Middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["authorization", "content-type"],
            expose_headers=["x-request-id"],
        )
        middleware.insert(0, cors)
    return Starlette(
        routes=routes(service, Auth(api_keys, admin_key)),
        middleware=middleware,
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )
