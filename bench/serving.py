"""The real OpenAI server on loopback, in this process: single node (an AsyncEngine) or disaggregated (a
Router in front of prefill and decode worker processes). Shared by the stress, soak and crash harnesses
and their tests.

Contracts: every address is on 127.0.0.1; every wait is bounded; `stop()` is idempotent. A worker can be
killed (SIGKILL) and restarted on the SAME address, which is how the crash tests exercise reconnection.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from multiprocessing import Process
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from kvfence.config import EngineConfig
from kvfence.disagg.launch import spawn_workers
from kvfence.disagg.router import ROUTER_TIMEOUT_S, Router
from kvfence.engine.stats import EngineStats
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path

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
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)
        self.sock.close()


def serve(app: FastAPI, start_timeout_s: float = START_TIMEOUT_S) -> ServerThread:
    """Start `app` on a free loopback port; returns once it accepts connections (lifespan ran)."""
    sock = socket.socket()
    sock.bind((LOOPBACK, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the HTTP server did not start")
        time.sleep(0.05)
    return ServerThread(f"http://{LOOPBACK}:{sock.getsockname()[1]}", server, thread, sock)


def metric(url: str, name: str, labels: dict[str, str] | None = None, timeout_s: float = 30.0) -> float:
    """One sample of the server's /metrics (KeyError when absent)."""
    text = httpx.get(f"{url}/metrics", timeout=timeout_s).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return float(sample.value)
    raise KeyError(name)


# ---- disaggregated ---------------------------------------------------------------------------------------


@dataclass
class WorkerProcess:
    role: str
    config: EngineConfig
    address: str
    process: Process

    def kill(self, timeout_s: float = 10.0) -> None:
        """kill -9, and wait for the process to be gone."""
        if self.process.is_alive() and self.process.pid is not None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.join(timeout=timeout_s)

    def restart(self) -> None:
        """A fresh process of the same role and config, bound to the SAME address (peers reconnect)."""
        self.kill()
        ((self.process, address),) = spawn_workers([(self.role, self.config)], bind=self.address)
        assert address == self.address, f"restarted on {address}, not {self.address}"


@dataclass
class Cluster:
    """Prefill and decode worker processes, the router in front of them, and the HTTP server."""

    router: Router
    server: ServerThread
    workers: dict[str, WorkerProcess] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.server.url

    def worker_stats(self, role: str) -> EngineStats:
        """One worker's pool counters (blocking, at most the router's stats timeout)."""
        reply = self.router._ask(self.workers[role].address, "stats")  # no public per-worker call yet
        return EngineStats.from_dict(reply.fields["stats"])

    def stop(self) -> None:
        self.server.stop()
        for worker in self.workers.values():
            worker.kill()


def start_cluster(
    prefill: EngineConfig,
    decode: EngineConfig,
    api_keys: dict[str, str] | None,
    admin_key: str | None,
    model_name: str,
    router_timeout_s: float = ROUTER_TIMEOUT_S,
    **app_options: Any,
) -> Cluster:
    """Spawn both workers (loading in parallel), start the router and the server in front of them."""
    from kvfence.api.server import build_app

    (p_proc, p_addr), (d_proc, d_addr) = spawn_workers([("prefill", prefill), ("decode", decode)])
    workers = {
        "prefill": WorkerProcess("prefill", prefill, p_addr, p_proc),
        "decode": WorkerProcess("decode", decode, d_addr, d_proc),
    }
    try:
        config, metadata = read_header(default_model_path())
        router = Router(p_addr, d_addr, Tokenizer(metadata), config.vocab_size, timeout_s=router_timeout_s)
        server = serve(build_app(router, model_name, api_keys, admin_key, **app_options))
    except BaseException:
        for worker in workers.values():
            worker.kill()
        raise
    return Cluster(router, server, workers)
