"""One HTTP app on loopback, in this process, and what a harness reads from a running server over HTTP.

Contracts: every address is on 127.0.0.1; every wait is bounded; `ServerThread.stop()` is idempotent.
`serve(app)` binds its socket before uvicorn starts, so there is no race for the port, and returns only
once the app's lifespan ran (its engine or router started). It serves behind the same front door as
`kvfence serve` (kvfence.api.slow_clients: read timeouts, connection cap), so tests exercise it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp

from kvfence.api.slow_clients import DEFAULT_MAX_CONNECTIONS, DEFAULT_READ_TIMEOUT_S, uvicorn_config

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 60.0


@dataclass
class ServerThread:
    """A uvicorn server for one app, on a socket bound here (no race for the port), in a daemon thread."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread
    sock: socket.socket

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit (the app's lifespan shuts its engine down), wait at most `timeout_s`."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        self.sock.close()


def serve(
    app: ASGIApp,
    start_timeout_s: float = START_TIMEOUT_S,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    front_door: bool = True,
) -> ServerThread:
    """Start `app` on a free loopback port behind the front door (`read_timeout_s` for a request head or a
    stalled body, at most `max_connections`); returns once it accepts connections (lifespan ran).
    `front_door` False: uvicorn's own protocol with the same cap, the protection off (tests show the leak)."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    settings: dict[str, Any] = {"log_level": "warning", "timeout_graceful_shutdown": 5}
    if front_door:
        config = uvicorn_config(app, read_timeout_s, max_connections, **settings)
    else:
        config = uvicorn.Config(app, http="h11", limit_concurrency=max_connections, **settings)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            sock.close()
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.05)
    return ServerThread(f"http://{LOOPBACK}:{sock.getsockname()[1]}", server, thread, sock)


@contextlib.contextmanager
def serving(app: ASGIApp) -> Iterator[str]:
    """`app` under uvicorn on a free loopback port, in a thread; yields its URL, stops it on exit."""
    server = serve(app)
    try:
        yield server.url
    finally:
        server.stop()


def metric(
    url: str,
    name: str,
    labels: dict[str, str] | None = None,
    admin_key: str | None = None,
    timeout_s: float = 30.0,
) -> float:
    """The server's /metrics samples `name` whose labels include `labels`, summed (a kvfence server has
    one series per pool role: no role label sums the pools). KeyError when there is none. A server with
    API keys serves /metrics to its admin key only."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    response = httpx.get(f"{url}/metrics", headers=headers, timeout=timeout_s)
    response.raise_for_status()
    text = response.text
    wanted = (labels or {}).items()
    values = [
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and wanted <= sample.labels.items()
    ]
    if not values:
        raise KeyError(name)
    return sum(values)


def audit_trail(url: str, admin_key: str, request_id: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
    """The request's trail from the admin endpoint (router, prefill and decode alike); [] when none."""
    response = httpx.get(
        f"{url}/v1/audit/requests/{request_id}",
        headers={"Authorization": f"Bearer {admin_key}"},
        timeout=timeout_s,
    )
    return response.json()["events"] if response.status_code == 200 else []


def healthy(url: str, timeout_s: float = 2.0) -> bool:
    """GET /health answered 200 (False for any transport error)."""
    try:
        return httpx.get(url + "/health", timeout=timeout_s).status_code == 200
    except httpx.TransportError:
        return False
