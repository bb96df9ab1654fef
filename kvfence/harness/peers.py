"""Peer engines for side-by-side runs: llama.cpp's `llama-server`, started on a GGUF file here.

Contract: `llama_server_binary(path)` finds the binary (a path given, `$KVFENCE_LLAMA_SERVER`, or the one
`../shared/peers/build-llama-server.sh` builds into ~/.cache/kvfence-peers), building it only when asked;
`llama_server(...)` starts it on loopback with the given threads, slots, context and API keys, waits for
/health, yields it (`Peer`: its base URL and process id) and stops it on leaving. Nothing here is fetched from
a hub: the peer is built from the llama-cpp-python sdist, and serves the same GGUF file kvfence does.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfence.harness.key_files import write_key_file

ENV = "KVFENCE_LLAMA_SERVER"
BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "shared" / "peers" / "build-llama-server.sh"
CACHED = Path.home() / ".cache/kvfence-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
START_TIMEOUT_S = 120.0


def llama_server_binary(path: Path | None = None, build: bool = False) -> Path:
    """The llama-server to run; FileNotFoundError naming the ways to get one."""
    for candidate in (path, Path(os.environ[ENV]) if os.environ.get(ENV) else None, CACHED):
        if candidate is not None and candidate.is_file():
            return candidate
    if build and BUILD_SCRIPT.is_file():
        built = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
        return Path(built.stdout.strip().splitlines()[-1])
    raise FileNotFoundError(f"no llama-server: give its path, set ${ENV}, or build it with {BUILD_SCRIPT}")


@dataclass(frozen=True)
class Peer:
    url: str
    pid: int


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def llama_server(
    binary: Path,
    model: Path,
    threads: int = 2,
    slots: int = 16,
    context: int = 8192,
    api_keys: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> Iterator[Peer]:
    """`binary` serving `model` on 127.0.0.1 with continuous batching over `slots` slots sharing `context`
    tokens of KV (each slot gets context / slots), `threads` threads for decode and batch work alike."""
    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp, Path(tmp, "llama-server.log").open("w") as log:
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
        command += ["-t", str(threads), "-tb", str(threads), "-np", str(slots), "-c", str(context)]
        if api_keys:
            command += ["--api-key-file", str(write_key_file(Path(tmp, "keys"), api_keys))]
        process = subprocess.Popen([*command, *extra], stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process)
            yield Peer(url, process.pid)
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"llama-server at {url} not healthy within {START_TIMEOUT_S:.0f} s")
