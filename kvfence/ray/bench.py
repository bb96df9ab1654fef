"""kvfence on a local Ray Serve cluster for benchmarks: one cluster (token authentication, as `kvfence serve
--ray-replicas` starts it) and the kvfence application deployed with one router after another.

    with ray_cluster(port, temp_dir) as url:
        with deployed(serve_args, replicas=2, cpus=0.5, router="kvfence"):
            ...  # kvfence.harness.chat_turns.chat_workload(url, ...)

Routers: `kvfence` (kvfence.ray.router), `power-of-two` (Ray's default) and `prefix-cache` (Ray Serve LLM's
PrefixCacheAffinityRouter, importable without vLLM, through kvfence.ray.llm_router: it reads
`ForwardedRequest.prompt`, raw text, into a detached prefix-tree actor shared by every tenant; for
comparison only, never a kvfence option). Every
router runs behind the same front, so they differ only in placement; both prefix routers get the same load
rule (a queue length difference of IMBALANCE_THRESHOLD).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvfence.ray.app import ROUTERS as APP_ROUTERS
from kvfence.ray.app import AppOptions, fronted
from kvfence.ray.local import OBJECT_STORE_BYTES, ray_token

PREFIX_CACHE_ROUTER = "kvfence.ray.llm_router:PrefixCacheOnPrompts"  # Ray LLM's, on prompts only
IMBALANCE_THRESHOLD = 2
ROUTERS: dict[str, tuple[str | None, dict[str, Any]]] = {
    "kvfence": (APP_ROUTERS["kvfence"], {"imbalance_threshold": IMBALANCE_THRESHOLD}),
    "power-of-two": (APP_ROUTERS["power-of-two"], {}),
    "prefix-cache": (PREFIX_CACHE_ROUTER, {"imbalanced_threshold": IMBALANCE_THRESHOLD}),
}
APP_NAME = "kvfence"


@contextlib.contextmanager
def ray_cluster(port: int, temp_dir: Path) -> Iterator[str]:
    """A local Ray cluster with token authentication and Serve's proxy on 127.0.0.1:`port`; its URL."""
    with ray_token(types.SimpleNamespace(ray_address=None, insecure_ray=False)):
        import ray
        from ray import serve

        ray.init(_temp_dir=str(temp_dir), object_store_memory=OBJECT_STORE_BYTES, include_dashboard=False)
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield f"http://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(Exception):  # stopping: what fails to stop is Ray's to report
                serve.shutdown()
            ray.shutdown()


@contextlib.contextmanager
def deployed(serve_args: Sequence[str], replicas: int, cpus: float, router: str) -> Iterator[None]:
    """The kvfence application with `router` on `replicas` servers, ready; deleted on leaving."""
    from ray import serve

    router_class, kwargs = ROUTERS[router]
    options = AppOptions(tuple(serve_args), replicas, cpus)
    serve.run(fronted(options, router_class, kwargs), name=APP_NAME, route_prefix="/")
    try:
        yield
    finally:
        serve.delete(APP_NAME)
