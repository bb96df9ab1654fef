"""Zero-trust disaggregation against real processes and real sockets (SmolLM2, CURVE between the three).

1. The two commands that must refuse to start without keys on a non-loopback address (exit 2, one line
   naming --keys and --insecure-transport, before the model is read).
2. SIGTERM of `kvfence serve --disaggregated`: no worker process and no bound port may be left behind.
3. Rogue peers against a running stack (router + HTTP here, prefill and decode worker processes): (a) a
   plain DEALER with no key, (b) a CURVE client whose key is not in the allow-list, (c) a process's own
   valid key used in the wrong role (prefill's key speaking to decode and to the router as if it were
   the router or decode, decode's key speaking to prefill). Each attack asserts outcomes: nothing comes
   back to the attacker, no trail exists for the attacker's request ids, the pools end all free, the
   honest requests running meanwhile answer exactly what they answered before the attack (greedy), and
   every dropped frame is counted by reason on the process that dropped it: exact counts, except
   `unknown_key` (at least one: the ZAP handler counts refused handshakes, not frames).

Parts 1 and 2 come first so that they run before the shared stack is started. The deeply nested JSON
header test is last on purpose: it records a known bug (that frame ends the worker process it reaches),
so the shared stack is not usable after it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvfence.config import EngineConfig
from kvfence.disagg.launch import free_ports
from kvfence.disagg.messages import (
    Audit,
    HelloReply,
    Msg,
    Output,
    Prefill,
    Reserve,
    encode,
)
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.procs import KVFENCE, descendants, launch
from kvfence.harness.server import healthy
from kvfence.harness.workers import Spawned
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path

pytestmark = pytest.mark.real_model

MODEL = default_model_path().stem
TENANT, API_KEY, ADMIN = "tenantA", "zt-key-a", "zt-admin"
WINDOW = 256
PREFILL = EngineConfig(num_pages=32, max_model_len=WINDOW, num_threads=1)
DECODE = EngineConfig(num_pages=32, max_model_len=WINDOW, num_threads=1, enable_prefix_caching=False)
HONEST = (
    "The capital of France is",
    "Once upon a time, a lighthouse keeper",
    "List three colors: red,",
)
MAX_TOKENS = 10
STREAM_PROMPT, STREAM_TOKENS = "Once upon a time, in a small village by the sea,", 24
QUIET_S = 2.0  # how long an attacker listens for anything coming back
WAIT_S = 30.0  # the bound on every other wait in the rogue-peer tests
REQUEST_TIMEOUT_S = 60.0
CLI_TIMEOUT_S = 60.0
# The real SIGTERM test: load time of two workers on a shared machine, and how long the parent may take.
SERVE_START_S, SERVE_STOP_S = 180.0, 30.0


# ---- 1. refused at start without keys -----------------------------------------------------------------

REMOTE_COMMANDS = {
    "worker": ["serve", "--role", "prefill", "--listen", "tcp://10.1.2.3:5600"],
    "router": ["router", "--prefill", "tcp://10.0.0.1:5600", "--decode", "tcp://10.0.0.2:5600"],
}
NO_MODEL = "/nonexistent/zero-trust-test.gguf"  # past the key check, loading fails fast with this name
REFUSAL = "is not a loopback address"


def _kvfence(*commands: list[str]) -> list[tuple[int, str]]:
    """Run `kvfence ARGS` for each of `commands` at once (each killed after CLI_TIMEOUT_S); the exit code
    and the output (stdout and stderr) of each."""
    procs = [
        subprocess.Popen([*KVFENCE, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for args in commands
    ]
    results = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=CLI_TIMEOUT_S)
            results.append((proc.returncode, output))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(timeout=CLI_TIMEOUT_S)
    return results


@pytest.mark.parametrize("command", sorted(REMOTE_COMMANDS))
def test_non_loopback_without_keys_is_refused_at_start(command: str) -> None:
    """A worker or router on a non-loopback address without --keys exits 2 with one line naming --keys
    and --insecure-transport, before any model is read (the model path given does not even exist)."""
    args = [*REMOTE_COMMANDS[command], "--model", NO_MODEL]
    (code, output), (allowed_code, allowed_output) = _kvfence(args, [*args, "--insecure-transport"])
    assert code == 2, output
    assert "Traceback" not in output and NO_MODEL not in output, output
    (line,) = [line for line in output.splitlines() if line.strip()]
    assert line.startswith("error:") and REFUSAL in line, line
    assert "--keys" in line and "--insecure-transport" in line, line
    # With --insecure-transport the check passes: the command goes on to the model, refused in turn (a
    # start-up error too: one line naming the missing file, exit 2).
    assert allowed_code == 2, allowed_output
    assert REFUSAL not in allowed_output and "Traceback" not in allowed_output, allowed_output
    assert "INSECURE" in allowed_output and NO_MODEL in allowed_output, allowed_output


# ---- 2. SIGTERM of `serve --disaggregated` leaves nothing behind -----------------------------------------

LISTENING = re.compile(r"\[(prefill|decode)\] listening on tcp://127\.0\.0\.1:(\d+)")


def _port_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port (a bind and listen succeed; TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
        except OSError:
            return False
    return True


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_sigterm_leaves_no_worker_and_no_port() -> None:
    """SIGTERM to the `serve --disaggregated` parent only: it exits, and so does every process below it
    (the two workers included: before the fix they lived on as orphans), freeing every port."""
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    args = ["serve", "--disaggregated", "--port", str(port), "--max-model-len", "1024"]
    args += ["--kv-cache-memory", "64MiB", "--num-threads", "1"]
    proc = launch("serve-disaggregated", args, echo=False)
    tree: list[int] = []
    try:
        proc.wait_for_http(url, SERVE_START_S)
        tree = descendants(proc.pid)
        workers = {m.group(1): int(m.group(2)) for line in proc.log if (m := LISTENING.search(line))}
        assert sorted(workers) == ["decode", "prefill"], proc.tail()
        assert len(tree) >= 2 and all(_alive(pid) for pid in tree), tree
        assert not any(_port_free(p) for p in (port, *workers.values())), "a port is not bound yet"

        proc.popen.send_signal(signal.SIGTERM)
        try:
            proc.popen.wait(timeout=SERVE_STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the parent did not exit within {SERVE_STOP_S:.0f}s of SIGTERM:\n{proc.tail()}")

        def left() -> list[int]:
            return [pid for pid in tree if _alive(pid)]

        _wait_until(lambda: not left(), 10.0)
        assert left() == [], f"processes outlived the parent: {left()}\n{proc.tail()}"
        busy = [p for p in (port, *workers.values()) if not _port_free(p)]
        assert busy == [], f"ports still bound after SIGTERM: {busy}"
    finally:
        proc.kill()
        for pid in (*tree, *descendants(proc.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ---- the honest side ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(read_header(default_model_path())[1])


@pytest.fixture(scope="module")
def prompts(tokenizer: Tokenizer) -> dict[str, list[int]]:
    """The honest prompts as token ids (what an attacker guessing them would send)."""
    return {text: tokenizer.encode(text, add_special_tokens=True) for text in (*HONEST, STREAM_PROMPT)}


@pytest.fixture(scope="module")
def stack() -> Iterator[Cluster]:
    with cluster(
        prefill=Spawned(PREFILL),
        decode=Spawned(DECODE),
        api_keys={API_KEY: TENANT},
        admin_key=ADMIN,
        model_name=MODEL,
    ) as running:
        yield running


@dataclass(frozen=True)
class Answer:
    text: str
    completion_tokens: int
    finish_reason: str
    request_id: str


def complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS) -> Answer:
    """One greedy completion of tenant A (token ids in, so an attacker's guess is exactly the prompt)."""
    response = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    return Answer(choice["text"], body["usage"]["completion_tokens"], choice["finish_reason"], body["id"])


def stream(url: str, prompt: list[int], max_tokens: int, first_chunk: threading.Event) -> Answer:
    """One greedy streamed completion; `first_chunk` is set when the first text arrives."""
    text, finish, request_id = "", "", ""
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
        timeout=REQUEST_TIMEOUT_S,
    ) as response:
        assert response.status_code == 200, response.read()
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data:"))
            assert "error" not in event, f"the stream ended with an error: {event}"
            for choice in event.get("choices", []):
                text += choice.get("text") or ""
                finish = choice.get("finish_reason") or finish
                if text:
                    first_chunk.set()
    return Answer(text, -1, finish, request_id)


@pytest.fixture(scope="module")
def baseline(stack: Cluster, prompts: dict[str, list[int]]) -> dict[str, Answer]:
    """Each honest prompt's answer before any attack (after a first run that fills prefill's prefix
    cache, so that every later run, during the attacks too, is served the same way)."""
    for text in HONEST:
        complete(stack.url, prompts[text])
    answers = {text: complete(stack.url, prompts[text]) for text in HONEST}
    answers[STREAM_PROMPT] = complete(stack.url, prompts[STREAM_PROMPT], STREAM_TOKENS)
    assert all(a.completion_tokens > 0 for a in answers.values())
    assert answers[STREAM_PROMPT].finish_reason == "length", "the stream to watch must run its full length"
    return answers


class HonestTraffic:
    """Tenant A's honest requests, one after another on a thread, while the attacks run."""

    def __init__(self, url: str, prompts: dict[str, list[int]]) -> None:
        self.url, self.prompts = url, prompts
        self.answers: list[tuple[str, Answer]] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for text in HONEST:
                    self.answers.append((text, complete(self.url, self.prompts[text])))
                    self._first.set()
        except BaseException as exc:  # reported by check()
            self.errors.append(exc)
            self._first.set()

    def __enter__(self) -> HonestTraffic:
        self._thread.start()
        assert self._first.wait(REQUEST_TIMEOUT_S), "no honest request completed"
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S)

    def check(self, baseline: dict[str, Answer]) -> None:
        """Every honest answer during the attack is the one before it (same text, same token count)."""
        assert not self._thread.is_alive(), "an honest request hangs"
        assert not self.errors, f"an honest request failed: {self.errors[0]!r}"
        assert len(self.answers) >= len(HONEST)
        for text, answer in self.answers:
            expected = baseline[text]
            assert (answer.text, answer.completion_tokens) == (expected.text, expected.completion_tokens)


# ---- the attackers --------------------------------------------------------------------------------------


@dataclass
class Rogue:
    """An attacker's DEALER to one process: no key at all, or CURVE with `keypair` (public, secret)."""

    name: str
    socket: zmq.Socket[Any]
    received: list[list[bytes]] = field(default_factory=list)

    def send(self, *frames: bytes) -> None:
        """Never blocks: a refused CURVE client has no connection left to queue on (libzmq does not retry
        after an authentication failure), and what cannot be queued is simply not sent. A valid-key
        attacker's frames always queue (its exact drop counts show it)."""
        with contextlib.suppress(zmq.Again):
            self.socket.send_multipart(list(frames), flags=zmq.NOBLOCK)

    def send_msg(self, message: Msg) -> None:
        self.send(*encode(message))

    def send_json(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.send(json.dumps(header).encode(), payload)


class Rogues:
    """Attackers on a private zmq.Context (never the cluster's), all closed on leaving."""

    def __init__(self, stack: Cluster) -> None:
        assert stack.transport is not None and stack.transport.keys is not None
        self.addresses = stack.transport.addresses
        self.keys = stack.transport.keys
        self.book = self.keys["router"].book
        self.context: zmq.Context[Any] = zmq.Context()
        self.all: list[Rogue] = []

    def dial(self, name: str, target: str, keypair: tuple[str, str] | None) -> Rogue:
        """A DEALER to `target` (a role: its address), keyless when `keypair` is None."""
        address = self.addresses[target]
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if keypair is not None:
            sock.curve_publickey, sock.curve_secretkey = (k.encode() for k in keypair)
            sock.curve_serverkey = self.book.by_address[address].public_key.encode()
        sock.connect(address)
        rogue = Rogue(f"{name}->{target}", sock)
        self.all.append(rogue)
        return rogue

    def keyless(self, target: str) -> Rogue:
        return self.dial("keyless", target, None)

    def unknown(self, target: str) -> Rogue:
        public, secret = (k.decode() for k in zmq.curve_keypair())
        assert public not in self.book.by_key
        return self.dial("unknown-key", target, (public, secret))

    def as_peer(self, role: str, target: str) -> Rogue:
        """`role`'s own valid keypair used to talk to `target` (a role it may not play there)."""
        identity = self.keys[role].identity
        return self.dial(f"{role}-key", target, (identity.public_key, identity.secret_key))

    def three(self, target: str, wrong_role: str) -> list[Rogue]:
        """(a) keyless, (b) unknown key, (c) `wrong_role`'s valid key, all at `target`."""
        return [self.keyless(target), self.unknown(target), self.as_peer(wrong_role, target)]

    def listen(self, seconds: float = QUIET_S) -> list[Rogue]:
        """Poll every attacker socket for `seconds`; the attackers that got anything back."""
        poller = zmq.Poller()
        for rogue in self.all:
            poller.register(rogue.socket, zmq.POLLIN)
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            for sock, _ in poller.poll(int(left * 1000) + 1):
                rogue = next(r for r in self.all if r.socket is sock)
                rogue.received.append(sock.recv_multipart())
        return [r for r in self.all if r.received]

    def close(self) -> None:
        for rogue in self.all:
            rogue.socket.close(linger=0)
        self.context.term()


@contextlib.contextmanager
def rogues(stack: Cluster) -> Iterator[Rogues]:
    attackers = Rogues(stack)
    try:
        yield attackers
    finally:
        attackers.close()


# ---- what the processes counted and hold ----------------------------------------------------------------

PROCESSES = ("router", "prefill", "decode")
Drops = dict[str, Counter[str]]


def drops(stack: Cluster) -> Drops:
    """Frames dropped so far, by process and reason (the router's own, each worker's via its stats)."""
    counted: Drops = {}
    for _ in range(10):  # the router's Counter is written by its I/O thread: copy it when it holds still
        with contextlib.suppress(RuntimeError):
            counted["router"] = Counter(dict(stack.router.rejected))
            break
    assert "router" in counted, "could not read the router's counters"
    for role in ("prefill", "decode"):
        counted[role] = Counter(stack.worker_stats(role).transport_rejected)
    return counted


def assert_dropped(
    stack: Cluster, before: Drops, expected: dict[str, dict[str, int]], unknown_key: tuple[str, ...] = ()
) -> Drops:
    """Wait (bounded) until each process dropped at least `expected` more frames by reason, then check
    the counts are exact: nothing else dropped anywhere. `unknown_key`: processes where refused CURVE
    clients were counted (at least once: a refused client reconnects)."""
    deadline = time.monotonic() + WAIT_S

    def delta() -> Drops:
        now = drops(stack)
        return {p: Counter({r: n for r, n in (now[p] - before[p]).items() if n}) for p in PROCESSES}

    while True:
        seen = delta()
        reached = all(seen[p][r] >= n for p, reasons in expected.items() for r, n in reasons.items())
        keys_seen = all(seen[p]["unknown_key"] >= 1 for p in unknown_key)
        if (reached and keys_seen) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    time.sleep(0.3)  # anything dropped late would be a frame we did not expect: let it show
    seen = delta()
    for process in PROCESSES:
        counted = Counter(seen[process])
        refused_keys = counted.pop("unknown_key", 0)
        assert counted == Counter(expected.get(process, {})), f"{process} dropped {dict(seen[process])}"
        if process in unknown_key:
            assert refused_keys >= 1, f"{process} counted no refused CURVE key"
    return seen


def assert_metrics_cover(stack: Cluster, seen: Drops) -> None:
    """/metrics shows the drops too: `kvfence_transport_rejected_total` by reason, per process where the
    series carry a `role` label, else summed over the three; at least what this attack added (earlier
    tests add to the same counters)."""
    headers = {"Authorization": f"Bearer {ADMIN}"}
    text = httpx.get(f"{stack.url}/metrics", headers=headers, timeout=WAIT_S).text
    exported: Counter[tuple[str | None, str]] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvfence_transport_rejected_total":
                exported[sample.labels.get("role"), sample.labels["reason"]] += int(sample.value)
    per_role = any(role is not None for role, _ in exported)
    for reason in {r for counted in seen.values() for r in counted}:
        if per_role:
            for process in PROCESSES:
                assert exported[process, reason] >= seen[process][reason], (process, reason, exported)
        else:
            assert exported[None, reason] >= sum(c[reason] for c in seen.values()), (reason, exported)


def assert_no_trail(stack: Cluster, *request_ids: str) -> None:
    """Nothing anywhere (router, prefill, decode) ever heard of these requests: the admin endpoint has
    no trail for them (404), and the router's own merge over the three is empty."""
    for request_id in request_ids:
        response = httpx.get(
            f"{stack.url}/v1/audit/requests/{request_id}",
            headers={"Authorization": f"Bearer {ADMIN}"},
            timeout=WAIT_S,
        )
        assert response.status_code == 404, f"{request_id}: {response.text[:300]}"
        assert stack.router.audit_events(request_id) == []


def assert_pools_free(stack: Cluster) -> None:
    """Both pools back to every page free (prefill's cached prefixes are free: evictable on demand)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = {role: stack.worker_stats(role) for role in ("prefill", "decode")}
        if all(s.pages_free == s.num_pages for s in stats.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for role, s in stats.items():
        assert s.pages_free == s.num_pages, f"{role}: {s.pages_free}/{s.num_pages} free {s.pages_by_state}"
        assert s.pages_by_state.get("quarantined", 0) == 0, role


def assert_all_alive(stack: Cluster) -> None:
    for role, worker in stack.workers.items():
        assert worker.pid is not None and _alive(worker.pid), f"the {role} worker process is gone"
    assert stack.router.alive, "the router's I/O thread is gone"
    assert healthy(stack.url, timeout_s=10.0)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# ---- 3. rogue peers against the real stack ----------------------------------------------------------------


def test_rogue_reserve_acts_as_no_tenant(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """`reserve` as tenantA (a one-token prompt decode would answer at once, and a guessed honest
    prompt) from each attacker at decode: decode reserves nothing, generates nothing, streams nothing."""
    before = drops(stack)
    ids = []
    with rogues(stack) as r, HonestTraffic(stack.url, prompts) as honest:
        for n, rogue in enumerate(r.three("decode", wrong_role="prefill")):
            for prompt in ([prompts[HONEST[0]][0]], prompts[HONEST[0]]):
                request_id = f"zt-reserve-{n}-{len(prompt)}"
                ids.append(request_id)
                params = {"max_tokens": 8, "temperature": 0.0}
                rogue.send_msg(Reserve(request_id, TENANT, prompt, params, r.addresses["prefill"]))
        assert r.listen() == [], "something came back to an attacker"
    honest.check(baseline)
    seen = assert_dropped(stack, before, {"decode": {"wrong_role": 2}}, unknown_key=("decode",))
    assert_metrics_cover(stack, seen)
    assert_no_trail(stack, *ids)
    assert_pools_free(stack)


def test_rogue_audit_reads_no_trail(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """`audit` of an honest request's id, at each worker, from each attacker: no reply anywhere (not to
    the attacker, and no audit_reply sent to the key's owner, which would drop it as wrong_role: so the
    two workers get different numbers of audits, and each must count exactly its own)."""
    victim = baseline[HONEST[0]].request_id
    assert stack.router.audit_events(victim), "the honest request has a trail to steal"
    before = drops(stack)
    audits = {"decode": 2, "prefill": 3}
    with rogues(stack) as r, HonestTraffic(stack.url, prompts) as honest:
        for target, wrong in (("decode", "prefill"), ("prefill", "decode")):
            for rogue in r.three(target, wrong_role=wrong):
                for n in range(audits[target]):
                    rogue.send_msg(Audit(token=f"q{n}", request_id=victim))
        assert r.listen() == [], "a trail came back to an attacker"
    honest.check(baseline)
    expected = {role: {"wrong_role": n} for role, n in audits.items()}
    assert_dropped(stack, before, expected, unknown_key=("decode", "prefill"))
    assert_pools_free(stack)


def test_rogue_prefill_gets_no_prefix_hit(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """`prefill` as tenantA with a guessed prompt (one tenant A's requests really sent, so it sits in
    prefill's prefix cache) from each attacker at prefill: no prefix hit, nothing computed, no page sent
    to decode. No honest traffic meanwhile: prefill's prefix-hit counter must hold still to prove it."""
    stats = {role: stack.worker_stats(role) for role in ("prefill", "decode")}
    guess = prompts[HONEST[1]]
    targets = [[0, 1]] * ((len(guess) - 2) // PREFILL.page_size + 1)
    before = drops(stack)
    ids = []
    with rogues(stack) as r:
        for n, rogue in enumerate(r.three("prefill", wrong_role="decode")):
            ids.append(f"zt-prefill-{n}")
            rogue.send_msg(Prefill(ids[-1], TENANT, guess, r.addresses["decode"], targets))
        assert r.listen() == [], "something came back to an attacker"
    assert_dropped(stack, before, {"prefill": {"wrong_role": 1}}, unknown_key=("prefill",))
    after = {role: stack.worker_stats(role) for role in ("prefill", "decode")}
    assert after["prefill"].prefix_hits == stats["prefill"].prefix_hits, "a guessed prompt hit the cache"
    assert after["decode"].refused_writes == stats["decode"].refused_writes, "pages were sent to decode"
    assert_no_trail(stack, *ids)
    assert_pools_free(stack)


def test_link_events_cannot_be_forged(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """`peer_down` / `peer_up` frames (once the connector's synthetic messages; now no message kind) sent
    to all three while a stream is open: dropped as unknown_kind, the stream goes on to its normal end
    with its usual text, and new requests are served (no 503 `decode_unavailable`)."""
    first_chunk = threading.Event()
    result: list[Answer | BaseException] = []

    def streaming() -> None:
        try:
            result.append(stream(stack.url, prompts[STREAM_PROMPT], STREAM_TOKENS, first_chunk))
        except BaseException as exc:
            result.append(exc)
            first_chunk.set()

    before = drops(stack)
    thread = threading.Thread(target=streaming, daemon=True)
    thread.start()
    assert first_chunk.wait(REQUEST_TIMEOUT_S), "the stream never started"
    forged = {
        "router": ("decode", "decode"),
        "decode": ("prefill", "prefill"),
        "prefill": ("decode", "decode"),
    }
    with rogues(stack) as r:
        for target, (wrong, lost) in forged.items():
            for rogue in r.three(target, wrong_role=wrong):
                rogue.send_json({"kind": "peer_down", "peer": r.addresses[lost]})
                rogue.send_json({"kind": "peer_up", "peer": r.addresses[lost]})
        thread.join(REQUEST_TIMEOUT_S)
        assert r.listen(0.5) == []
    assert not thread.is_alive(), "the stream hangs"
    (streamed,) = result
    assert isinstance(streamed, Answer), f"the stream failed: {streamed!r}"
    expected = baseline[STREAM_PROMPT]
    assert (streamed.text, streamed.finish_reason) == (expected.text, expected.finish_reason)
    for text in HONEST:
        assert complete(stack.url, prompts[text]).text == baseline[text].text
    expected_drops = {process: {"unknown_kind": 2} for process in PROCESSES}
    seen = assert_dropped(stack, before, expected_drops, unknown_key=PROCESSES)
    assert_metrics_cover(stack, seen)
    assert_pools_free(stack)


def _audit_info(stack: Cluster) -> dict[str, Any]:
    response = httpx.get(
        f"{stack.url}/v1/audit/info", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=WAIT_S
    )
    assert response.status_code == 200, response.text
    info: dict[str, Any] = response.json()
    return info


def test_forged_hello_reply_changes_no_pool(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """`hello_reply` with isolation off and a 1e9-token pool, to the router, from each worker's own key
    (a role that may send it) with every token the router could have used (q0.., re0..), and from the
    keyless and unknown-key attackers: the router's view of both pools, its window, /v1/audit/info and
    its admission are unchanged; `output` for an honest request from prefill's key is dropped too."""
    workers, window, info = dict(stack.router.workers), stack.router.max_model_len, _audit_info(stack)
    tokens = [f"{prefix}{n}" for prefix in ("q", "re") for n in range(60)]
    before = drops(stack)
    with rogues(stack) as r, HonestTraffic(stack.url, prompts) as honest:
        attackers = [(r.keyless("router"), "prefill"), (r.unknown("router"), "decode")]
        attackers += [(r.as_peer(role, "router"), role) for role in ("prefill", "decode")]
        for rogue, role in attackers:
            for token in tokens:
                rogue.send_msg(
                    HelloReply(
                        token=token,
                        role=role,
                        capacity_tokens=10**9,
                        max_model_len=10**6,
                        page_size=PREFILL.page_size,
                        isolation=False,
                        info={"isolation": False, "num_pages": 10**9},
                    )
                )
        victim = baseline[HONEST[2]].request_id
        prefill_key = attackers[2][0]
        prefill_key.send_msg(Output(victim, [42], " forged", True, "finished", "stop", 1, 1))
        assert r.listen() == []
    honest.check(baseline)
    expected = {"router": {"unsolicited": 2 * len(tokens), "wrong_role": 1}}
    seen = assert_dropped(stack, before, expected, unknown_key=("router",))
    assert_metrics_cover(stack, seen)
    assert stack.router.workers == workers
    assert all(w.isolation and w.capacity_tokens < 10**6 for w in stack.router.workers.values())
    assert stack.router.max_model_len == window
    assert _audit_info(stack) == info
    # Admission still uses the real pools: what only the forged pool could hold is refused up front.
    response = httpx.post(
        f"{stack.url}/v1/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": MODEL, "prompt": prompts[HONEST[0]], "max_tokens": 4 * WINDOW},
        timeout=REQUEST_TIMEOUT_S,
    )
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert_pools_free(stack)


def _malformed(rogue: Rogue) -> None:
    """One of each: not UTF-8, no kind, one frame, three frames, a 1 MiB field, a prompt longer than any
    model window, a payload on a kind that carries none, a header that is JSON but no object."""
    rogue.send(b"\xff\xfe\x80 not utf-8 {", b"")
    rogue.send(b'{"request_id": "zt-no-kind"}', b"")
    rogue.send(b'{"kind": "audit", "token": "t", "request_id": "zt-one-frame"}')
    rogue.send(b'{"kind": "audit", "token": "t", "request_id": "zt-three"}', b"", b"extra")
    big = {"kind": "abort", "request_id": "x" * (1 << 20), "reason": "huge"}
    rogue.send_json(big)
    long_prompt = [1] * (1 << 16)
    rogue.send_msg(Reserve("zt-long", TENANT, long_prompt, {}, "tcp://127.0.0.1:1"))
    rogue.send_json({"kind": "abort", "request_id": "zt-payload", "reason": "x"}, b"\0" * 64)
    rogue.send(b"[1, 2, 3]", b"")


MALFORMED = {"not_json": 2, "unknown_kind": 1, "frame_count": 2, "bad_field": 3}


def test_malformed_frames_end_no_process(
    stack: Cluster, prompts: dict[str, list[int]], baseline: dict[str, Answer]
) -> None:
    """Malformed frames to every process from every attacker: each valid-key frame is dropped and
    counted by reason, every process stays up (pids alive, /health 200) and answers as before."""
    before = drops(stack)
    pids = {role: worker.pid for role, worker in stack.workers.items()}
    with rogues(stack) as r, HonestTraffic(stack.url, prompts) as honest:
        for target, wrong in (("router", "prefill"), ("prefill", "decode"), ("decode", "prefill")):
            for rogue in r.three(target, wrong_role=wrong):
                _malformed(rogue)
        assert r.listen() == []
    honest.check(baseline)
    seen = assert_dropped(stack, before, dict.fromkeys(PROCESSES, MALFORMED), unknown_key=PROCESSES)
    assert_metrics_cover(stack, seen)
    assert {role: worker.pid for role, worker in stack.workers.items()} == pids
    assert_all_alive(stack)
    for text in HONEST:
        assert complete(stack.url, prompts[text]).text == baseline[text].text
    assert_pools_free(stack)


# ---- last: were it to fail, it would end the shared stack's workers ------------------------------------


def test_deeply_nested_header_ends_no_worker(stack: Cluster, prompts: dict[str, list[int]]) -> None:
    """A valid-key frame whose header nests 5000 arrays, to each process: none may end. (It did: json.loads
    raised RecursionError, which the parser let through and which ended a worker's loop and process.)"""
    nested = b'{"kind": "audit", "token": "t", "request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with rogues(stack) as r:
        for target, wrong in (("router", "prefill"), ("prefill", "decode"), ("decode", "prefill")):
            r.as_peer(wrong, target).send(nested, b"")
        r.listen(QUIET_S)
    assert_all_alive(stack)
    complete(stack.url, prompts[HONEST[0]])
