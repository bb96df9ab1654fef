"""The front door (issue 14): slow clients are cut and cannot crowd out a real request; every bad start-up
option is one line, before the model loads; the console says what protects the server.

The slow-client tests serve a small app through kvfence.harness.server.serve, which runs the same front
door as `kvfence serve` (kvfence.api.slow_clients); the protection is in the HTTP protocol, below any app.
The start-up tests run `kvfence serve` and `kvfence router` as subprocesses; the last test starts a real,
small server and talks to it.
"""

from __future__ import annotations

import asyncio
import os
import re
import selectors
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest
from conftest import make_engine
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from kvfence.cli_checks import StartupError, check_engine
from kvfence.cli_model import model_shape
from kvfence.config import CapacityError, EngineConfig
from kvfence.disagg.launch import free_ports
from kvfence.harness.cluster import Front as ClusterFront
from kvfence.harness.procs import KVFENCE, launch, stop
from kvfence.harness.server import LOOPBACK, serve
from kvfence.model.gguf import read_header
from kvfence.model.gguf_file import GGUFFile
from kvfence.model.transformer import Transformer

READ_TIMEOUT_S = 2.0  # the front door's timeout in these tests (the default is 10 s)
# How long past the timeout to keep trickling before calling a connection never cut: a bound on the wait,
# not a speed check (the trickling stops as soon as every one is closed; a busy machine cuts late).
SLACK_S = 60.0
SLOW_CLIENTS = 300
TRICKLE_EVERY_S = 1.0
# A request head that never completes while a test trickles it.
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"x" * 200


def front_app() -> Starlette:
    async def health(_: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def echo(request: Request) -> JSONResponse:
        try:
            return JSONResponse({"bytes": len(await request.body())})
        except ClientDisconnect:  # the front door cut the body
            return JSONResponse({"bytes": -1})

    async def slow(_: Request) -> JSONResponse:
        await asyncio.sleep(READ_TIMEOUT_S * 1.5)  # the app working is never cut
        return JSONResponse({"status": "done"})

    return Starlette(
        routes=[Route("/health", health), Route("/echo", echo, methods=["POST"]), Route("/slow", slow)]
    )


@pytest.fixture
def server() -> Iterator[str]:
    running = serve(front_app(), read_timeout_s=READ_TIMEOUT_S)
    try:
        yield running.url
    finally:
        running.stop()


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


class Tricklers:
    """`count` loopback connections, each sending one more byte of `SLOW_HEAD` per `tick`; records when the
    server closed each one (EOF or reset, seen by `poll`)."""

    def __init__(self, url: str, count: int) -> None:
        self.selector = selectors.DefaultSelector()
        self.socks: list[socket.socket] = []
        self.opened: list[float] = []
        self.closed: dict[int, float] = {}
        self.sent = 0
        for index in range(count):
            sock = socket.create_connection(address(url), timeout=5)
            sock.setblocking(False)
            self.socks.append(sock)
            self.opened.append(time.monotonic())
            self.selector.register(sock, selectors.EVENT_READ, index)

    def close(self) -> None:
        self.selector.close()
        for sock in self.socks:
            sock.close()

    def tick(self) -> None:
        byte = SLOW_HEAD[self.sent : self.sent + 1]
        self.sent += 1
        for index, sock in enumerate(self.socks):
            if index not in self.closed:
                try:
                    sock.send(byte)
                except OSError:
                    self._closed(index)

    def poll(self, timeout_s: float) -> None:
        for key, _ in self.selector.select(max(timeout_s, 0)):
            try:
                data = key.fileobj.recv(4096)  # type: ignore[union-attr]
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._closed(key.data)

    def _closed(self, index: int) -> None:
        if index not in self.closed:
            self.closed[index] = time.monotonic()
            self.selector.unregister(self.socks[index])

    def trickle_until(self, deadline: float) -> None:
        """One byte per connection every TRICKLE_EVERY_S until `deadline` or until all are closed."""
        while time.monotonic() < deadline and len(self.closed) < len(self.socks):
            self.tick()
            next_tick = time.monotonic() + TRICKLE_EVERY_S
            while (now := time.monotonic()) < min(next_tick, deadline) and len(self.closed) < len(self.socks):
                self.poll(min(next_tick, deadline) - now)


def test_slow_clients_are_cut_while_a_real_request_is_served(server: str) -> None:
    """300 connections trickling one header byte a second: a real request is served while they are open,
    and the server closes every one of them once the read timeout has passed."""
    assert httpx.get(f"{server}/health", timeout=10).status_code == 200
    slow = Tricklers(server, SLOW_CLIENTS)
    try:
        slow.tick()
        response = httpx.post(f"{server}/echo", content=b"x" * 1000, timeout=10)
        assert response.status_code == 200 and response.json() == {"bytes": 1000}
        slow.poll(0)
        assert not slow.closed, "slow connections were cut before the real request was answered"
        slow.trickle_until(slow.opened[-1] + READ_TIMEOUT_S + SLACK_S)
    finally:
        slow.close()
    still_open = SLOW_CLIENTS - len(slow.closed)
    assert still_open == 0, f"{still_open} of {SLOW_CLIENTS} trickling connections were never closed"
    lifetimes = [slow.closed[i] - opened for i, opened in enumerate(slow.opened)]
    # A lower bound only (load can lengthen a lifetime, never shorten it): none was cut before its timeout.
    assert min(lifetimes) >= READ_TIMEOUT_S - 0.5, f"cut after {min(lifetimes):.2f}s, before the timeout"


def _wait_closed(sock: socket.socket, result: dict[str, Any]) -> None:
    """In a thread: how long until the server closes `sock` (EOF or reset) and what it sent before. The
    socket's own timeout is only a guard against a server that never cuts (`closed_by_server` is False)."""
    started, received = time.monotonic(), b""
    sock.settimeout(READ_TIMEOUT_S * 10)
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except OSError as exc:
        result["error"] = exc
    result["after_s"], result["received"] = time.monotonic() - started, received


def closed_by_server(cut: dict[str, Any]) -> bool:
    """The server cut the connection (EOF or reset), rather than our guard giving up waiting for it."""
    return not isinstance(cut.get("error"), TimeoutError)


def _reply(sock: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length body."""
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < _length(data):
        chunk = sock.recv(4096)
        assert chunk, f"closed after {data!r}"
        data += chunk
    return data


def _length(data: bytes) -> int:
    match = re.search(rb"content-length: (\d+)", data, re.IGNORECASE)
    return int(match.group(1)) if match else 0


def test_a_stalled_body_is_cut_but_a_slow_one_is_not(server: str) -> None:
    """A body that stops is cut after the timeout; one that keeps coming (a byte every quarter timeout,
    1.5 timeouts in all) is read to the end and answered: the body timer measures stalls, not length."""
    head = b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 6\r\n\r\n"
    with (
        socket.create_connection(address(server)) as steady,
        socket.create_connection(address(server)) as stalled,
    ):
        stalled.sendall(head + b"12")
        cut: dict[str, Any] = {}
        watcher = threading.Thread(target=_wait_closed, args=(stalled, cut))
        watcher.start()
        steady.sendall(head)
        for _ in range(6):
            time.sleep(READ_TIMEOUT_S / 4)
            steady.sendall(b"x")
        reply = _reply(steady)
        watcher.join()
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":6}'), reply
    assert cut["received"] == b"", cut  # cut without an answer
    assert closed_by_server(cut) and cut["after_s"] >= READ_TIMEOUT_S - 0.5, cut


def test_a_slow_answer_and_keep_alive_are_not_cut_but_a_slow_next_head_is(server: str) -> None:
    """No timer runs while the app works (an answer that takes 1.5 timeouts arrives); after an answer the
    next request head is awaited under the same timeout."""
    with httpx.Client(base_url=server, timeout=30) as client:
        assert client.get("/slow").json() == {"status": "done"}
        assert client.get("/health").status_code == 200
    with socket.create_connection(address(server)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _reply(sock).startswith(b"HTTP/1.1 200")
        sock.sendall(b"GET /hea")  # the next head, never finished
        cut: dict[str, Any] = {}
        _wait_closed(sock, cut)
    assert cut["received"] == b"" and closed_by_server(cut), cut


def held_heads(url: str, count: int) -> list[socket.socket]:
    """`count` keyless connections, each holding a partial request head."""
    socks = [socket.create_connection(address(url), timeout=5) for _ in range(count)]
    for sock in socks:
        sock.sendall(SLOW_HEAD[:40])
    return socks


def closed_count(socks: list[socket.socket], wait_s: float = 1.0) -> int:
    """How many of `socks` the server has closed (EOF or reset), once the closes in flight have landed."""
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        ready = [key.fileobj for key, _ in selector.select(wait_s)]
    closed = 0
    for sock in ready:
        try:
            closed += sock.recv(1) == b""  # type: ignore[union-attr]
        except OSError:
            closed += 1
    return closed


@pytest.mark.parametrize("front_door", [False, True], ids=["protection off", "front door"])
def test_keyless_partial_heads_cannot_crowd_out_requests(front_door: bool) -> None:
    """Issue 27's scenario, scaled to 16 places: a keyless client holds more partial request heads than the
    server has places and opens fresh ones as its old ones go. uvicorn's own protocol answers every request
    503 while they are held; the front door gives each new connection the place of the one that has waited
    longest for its head, so every request is answered and the held heads are what it closed."""
    cap = 16
    running = serve(front_app(), read_timeout_s=60, max_connections=cap, front_door=front_door)
    held: list[socket.socket] = []
    try:
        statuses = []
        for _ in range(3):  # the attacker refreshes: a new wave of partial heads, then a real request
            held += held_heads(running.url, cap)
            statuses.append(httpx.get(f"{running.url}/health", timeout=10).status_code)
        if not front_door:
            assert statuses == [503, 503, 503]
            return
        assert statuses == [200, 200, 200]
        assert closed_count(held) >= 2 * cap  # every wave but the newest made way
    finally:
        for sock in held:
            sock.close()
        running.stop()


# ---- start-up options -----------------------------------------------------------------------------------

WORKERS = ["--prefill", "tcp://127.0.0.1:5600", "--decode", "tcp://127.0.0.1:5601"]
INSECURE = "WARNING: the transport is INSECURE"  # a worker or router on loopback without keys says so first
BAD_OPTIONS: dict[str, tuple[list[str], str]] = {  # case -> arguments, what the error line must name
    "missing model": (["serve", "--model", "/nonexistent.gguf"], "--model /nonexistent.gguf"),
    "non-GGUF model": (["serve", "--model", "{not_gguf}"], "--model {not_gguf}"),
    "model is a directory": (["serve", "--model", "{tmp}"], "--model {tmp}"),
    "page size 0": (["serve", "--page-size", "0"], "--page-size"),
    "no pages": (["serve", "--num-pages", "0"], "--num-pages"),
    "no memory": (["serve", "--kv-cache-memory", "0"], "--kv-cache-memory"),
    "no memory for a page": (["serve", "--kv-cache-memory", "1KiB"], "--kv-cache-memory"),
    "max-num-seqs 0": (["serve", "--max-num-seqs", "0"], "--max-num-seqs"),
    "max-num-batched-tokens -1": (["serve", "--max-num-batched-tokens", "-1"], "--max-num-batched-tokens"),
    "max-model-len 0": (["serve", "--max-model-len", "0"], "--max-model-len"),
    "window beyond the model's": (["serve", "--max-model-len", "999999"], "--max-model-len 8192 "),
    "window beyond the pool": (["serve", "--num-pages", "64"], "--max-model-len 1024 "),
    "port out of range": (["serve", "--port", "99999"], "--port"),
    "port in use": (["serve", "--port", "{busy_port}"], "--port {busy_port}"),
    "missing key file": (["serve", "--api-keys", "/nonexistent.txt"], "--api-keys /nonexistent.txt"),
    "malformed key file": (["serve", "--api-keys", "{bad_keys}"], "--api-keys {bad_keys}"),
    "admin key is a tenant's": (
        ["serve", "--api-keys", "{keys}", "--admin-key-file", "{tenant_admin_key}"],
        "--admin-key-file {tenant_admin_key}: it is also a tenant key",
    ),
    # A key on the command line: refused, naming what replaces it (argparse alone would say only
    # "unrecognized arguments"), and the key is not repeated.
    "admin key in argv": (["serve", "--admin-key", "s3cret"], "pass --admin-key-file FILE"),
    "router: admin key in argv": (
        ["router", *WORKERS, "--admin-key", "s3cret"],
        "pass --admin-key-file FILE",
    ),
    "admin key file open to others": (
        ["serve", "--admin-key-file", "{open_admin_key}"],
        "--admin-key-file {open_admin_key}: its mode 0644 gives other users access",
    ),
    "key file open to others": (
        ["serve", "--api-keys", "{open_keys}"],
        "--api-keys {open_keys}: its mode 0640",
    ),
    "admin key file is a directory": (["serve", "--admin-key-file", "{tmp}"], "{tmp}: not a regular file"),
    "empty admin key file": (["serve", "--admin-key-file", "{empty_admin_key}"], "holds no key"),
    "read timeout 0": (["serve", "--http-read-timeout", "0"], "--http-read-timeout"),
    "no connections": (["serve", "--max-connections", "0"], "--max-connections"),
    "unknown fault": (["serve", "--inject-fault", "no_such_fault"], "--inject-fault"),
    "worker: missing model": (["serve", "--role", "decode", "--model", "/nonexistent.gguf"], "--model"),
    "worker: window": (["serve", "--role", "prefill", "--max-model-len", "999999"], "--max-model-len 8192 "),
    "disaggregated: window": (["serve", "--disaggregated", "--num-pages", "64"], "--max-model-len 1024 "),
    "router: non-GGUF model": (["router", *WORKERS, "--model", "{not_gguf}"], "--model {not_gguf}"),
    "router: port in use": (["router", *WORKERS, "--port", "{busy_port}"], "--port {busy_port}"),
    "router: missing key file": (["router", *WORKERS, "--api-keys", "/nonexistent.txt"], "--api-keys"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The paths and the busy port the cases name: a non-GGUF file, key files (mode 0600 unless named open),
    a port someone listens on."""
    tmp = tmp_path_factory.mktemp("front-door")
    (tmp / "model.gguf").write_text("not a model\n")
    secrets = {
        "bad_keys": ("key-a tenant-a\nkey-b\n", 0o600),
        "keys": ("key-a tenant-a\nkey-b tenant-b\n", 0o600),
        "open_keys": ("key-a tenant-a\n", 0o640),
        "admin_key": ("admin-secret\n", 0o600),
        "tenant_admin_key": ("key-a\n", 0o600),
        "open_admin_key": ("admin-secret\n", 0o644),
        "empty_admin_key": ("\n", 0o600),
    }
    for name, (text, mode) in secrets.items():
        (tmp / name).write_text(text)
        (tmp / name).chmod(mode)  # whatever the umask made it
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        yield {
            "tmp": str(tmp),
            "not_gguf": str(tmp / "model.gguf"),
            **{name: str(tmp / name) for name in secrets},
            "busy_port": str(busy.getsockname()[1]),
        }


@pytest.fixture(scope="module")
def no_torch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment in which `import torch` fails: what runs in it provably never loaded a model."""
    poisoned = tmp_path_factory.mktemp("no-torch")
    (poisoned / "torch").mkdir()
    (poisoned / "torch" / "__init__.py").write_text("raise ImportError('torch imported before a refusal')\n")
    return {**os.environ, "PYTHONPATH": str(poisoned)}


def kvfence(args: list[str], env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """`kvfence ARGS`: the exit code and the non-empty lines on stderr."""
    done = subprocess.run([*KVFENCE, *args], capture_output=True, text=True, timeout=120, env=env)
    return done.returncode, [line for line in done.stderr.splitlines() if line.strip()]


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_a_bad_start_up_option_is_one_line_before_the_model_loads(
    case: str, files: dict[str, str], no_torch: dict[str, str]
) -> None:
    """Refused before the model loads: the refusal comes in a process where torch cannot even be imported
    (the order of events, not the clock: a model load would have raised first and printed a traceback)."""
    args, named = BAD_OPTIONS[case]
    code, lines = kvfence([arg.format(**files) for arg in args], env=no_torch)
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    errors = [line for line in lines if not line.startswith(INSECURE)]
    assert code == 2 and len(errors) == 1, f"exit {code}:\n" + "\n".join(lines)
    assert errors[0].startswith("error: ") and named.format(**files) in errors[0], errors[0]
    assert "s3cret" not in errors[0] and "admin-secret" not in errors[0]  # no key is ever echoed


@pytest.mark.parametrize(
    ("overrides", "suggested"),
    [
        ({"max_model_len": 999999}, 8192),  # the pool holds 11648 tokens: the model's window is the limit
        ({"num_pages": 64}, 1024),  # the pool is the limit
        ({"num_pages": 400, "max_model_len": 999999}, 6400),  # both too small: the smaller one
    ],
)
def test_the_suggested_max_model_len_is_the_smaller_limit_and_passes(
    overrides: dict[str, int], suggested: int
) -> None:
    """The check before loading (the real model's header): following its suggestion passes it."""
    with pytest.raises(StartupError, match=f"--max-model-len {suggested} "):
        check_engine(EngineConfig(**overrides))
    check_engine(EngineConfig(**{**overrides, "max_model_len": suggested}))


def test_the_engine_suggests_what_it_can_start_with(tiny: Transformer) -> None:
    """The engine's own check (after loading): a window beyond the model's (512) and a pool of 1024
    tokens suggest 512, and the engine starts with it (it used to suggest the pool, then fail)."""
    with pytest.raises(CapacityError, match="--max-model-len 512 ") as err:
        make_engine(tiny, num_pages=256, max_model_len=4096)
    assert err.value.suggested_max_model_len == 512
    make_engine(tiny, num_pages=256, max_model_len=512)


def test_the_fast_header_read_agrees_with_gguf_py(tmp_path: Path) -> None:
    """The start-up check reads the header's scalars only (`arrays=False`); the shape it finds is the
    model loader's, and its metadata is gguf-py's, arrays left out."""
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in [("block_count", 3), ("context_length", 96), ("embedding_length", 16)]:
        getattr(writer, f"add_{add}")(value)
    writer.add_feed_forward_length(24)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_token_list([f"tok{i}" for i in range(40)])
    writer.add_token_scores([0.0] * 40)
    writer.add_token_types([1] * 39 + [3])
    writer.add_add_bos_token(True)
    writer.add_tensor("token_embd.weight", np.zeros((40, 16), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(16, dtype=np.float32))
    shapes = {"attn_q": (16, 16), "attn_k": (8, 16), "attn_v": (8, 16), "attn_output": (16, 16)}
    shapes |= {
        "ffn_gate": (24, 16),
        "ffn_up": (24, 16),
        "ffn_down": (16, 24),
        "attn_norm": (16,),
        "ffn_norm": (16,),
    }
    for layer in range(3):
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", np.zeros(shape, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config, _ = read_header(path)
    scalars = GGUFFile(path, arrays=False).metadata
    expected = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}
    assert scalars == {k: v for k, v in expected.items() if not isinstance(v, list)}
    assert GGUFFile(path).metadata == expected
    shape = model_shape(scalars, {tensor.kind for tensor in GGUFFile(path, arrays=False).tensors})
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.context_length) == (
        config.num_layers,
        config.num_kv_heads,
        config.head_dim,
        config.context_length,
    )
    assert not shape.block_quantized  # float32 tensors only: the pool is sized at the model's dtype
    assert not shape.bf16_weights  # nothing for --activation-dtype bfloat16 to multiply
    kinds = [{0, 30}, {0, 1, 30}, {0, 2, 30}]  # F32 norms beside BF16; and F16, Q4_0 among them
    assert [model_shape(scalars, k).bf16_weights for k in kinds] == [True, False, False]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(StartupError, match="not a usable GGUF file"):
        check_engine(EngineConfig(model=cut))


# ---- the console ----------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_the_console_says_what_protects_the_server(files: dict[str, str]) -> None:
    """A small real server with API keys, an admin key and a fault armed, started with the window its own
    refusal suggested: the console names each protection, and its front door cuts a trickling client while
    it serves. No key is in its command line (which every local user can read), and the admin key read
    from its file (the newline dropped) opens /metrics. Without keys, the console says auth is off and the
    metrics are open."""
    code, lines = kvfence(["serve", "--num-pages", "64"])
    match = re.search(r"--max-model-len (\d+) ", lines[-1])
    assert code == 2 and match, lines
    port, bare_port = free_ports(2)
    url = f"http://{LOOPBACK}:{port}"
    args = ["serve", "--num-pages", "64", "--max-model-len", match.group(1), "--port", str(port)]
    args += [
        "--api-keys",
        files["keys"],
        "--admin-key-file",
        files["admin_key"],
        "--inject-fault",
        "stale_mapping:1.0",
    ]
    args += ["--http-read-timeout", str(READ_TIMEOUT_S), "--num-threads", "1"]
    proc = launch("front-door", args, echo=False)
    try:
        proc.wait_for_http(url, 180)
        said = [line.strip() for line in proc.log]
        for line in (
            "isolation: ON",
            "auth: on (2 tenants)",
            "metrics: admin key required",
            "WARNING: fault armed: stale_mapping at rate 1.0",
            f"front door: a request head within {READ_TIMEOUT_S:g}s, a body stalled for {READ_TIMEOUT_S:g}s "
            "is cut, at most 1024 connections",
            # The defaults are the fast path: a float16 pool (half the float32 one's 45.0 MiB), said so.
            "KV pool: 64 pages x 16 tokens = 1024 tokens (22.5 MiB); context window: 1024 tokens",
            "numerics: fast (int8 activations, float16 KV cache; --activation-dtype float32 for the exact "
            "float32 path)",
        ):
            assert line in said, proc.tail()
        assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401  # auth is on
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert files["admin_key"].encode() in argv  # the process read: the file is named, no key is
        assert not [arg for arg in argv if b"admin-secret" in arg or b"key-a" in arg or b"key-b" in arg]
        for key, status in (("admin-secret", 200), ("key-a", 403)):
            bearer = {"Authorization": f"Bearer {key}"}
            assert httpx.get(f"{url}/metrics", headers=bearer, timeout=10).status_code == status
        with socket.create_connection((LOOPBACK, port)) as sock:
            sock.sendall(SLOW_HEAD[:10])
            cut: dict[str, Any] = {}
            _wait_closed(sock, cut)
        assert cut["received"] == b"" and closed_by_server(cut), cut
    finally:
        stop([proc])
    bare = launch("front-door-bare", ["serve", "--port", str(bare_port), "--isolation", "off"], echo=False)
    try:
        bare.wait_for_line("front door:", 60)
        said = [line.strip() for line in bare.log]
        assert "metrics: open (no API keys)" in said, bare.tail()
        assert any(line.startswith("WARNING: auth: off") for line in said), bare.tail()
        assert any(line.startswith("WARNING: isolation: OFF") for line in said), bare.tail()
    finally:
        stop([bare])


def test_the_harness_gives_a_front_process_its_keys_in_its_environment() -> None:
    """What the tests and benches start (`cluster(serve_args=...)`, a router process) carries no key in its
    command line: the keys travel in the environment, which only the process's own user can read."""
    front = ClusterFront(api_keys={"key-a": "tenant-a"}, admin_key="admin-secret", isolation=False)
    assert not [flag for flag in front.flags() if "admin-secret" in flag or "key-a" in flag]
    assert front.env() == {"KVFENCE_API_KEYS": "key-a tenant-a", "KVFENCE_ADMIN_KEY": "admin-secret"}
