"""What the tests of the vLLM plugin (plugins/vllm, issue 62) share: one `vllm serve` per configuration
(each test module starts its own once, module-scoped, and every check of that module reuses it: a start
costs a vLLM import and a model load on a busy 2-core machine), the requests, the trail and the metrics.

`make test-vllm` runs them: it builds vLLM's environment with the peers script, layers the plugin over it
(plugins/vllm/overlay-env.sh) and names the serve script in $KVFENCE_TEST_VLLM. Elsewhere they skip.
Every server is eager (`--optimization-level 0`: no torch.compile, which would cost about a minute a start
and changes no block table) with a 1,024-token window (the audit's long prompts are sized by it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvfence.harness.peers import VLLM_MODEL, Peer, vllm_server

SERVE = os.environ.get("KVFENCE_TEST_VLLM", "")
needs_vllm = pytest.mark.skipif(not SERVE, reason="vLLM's CPU build and the plugin: `make test-vllm`")
START_TIMEOUT_S = 900.0  # a busy 2-core machine
BASE = ["--optimization-level", "0", "--max-model-len", "1024"]
KEYS = ("sk-tenant-a", "sk-tenant-b")  # vLLM's --api-key: the plugin's tenants api-key-1 and api-key-2
# The swap at a rate the audit can compare answers under (most requests beside others survive it), with a
# seed whose first draw fires: the first step that runs two requests with KV (the start-moved one spared)
# swaps their rows. And the start of the request furthest along in the first step of two or more with one
# decoding (the scenario's long one, its prompt the longest) moved a block ahead, once per server.
FAULT = {"KVFENCE_INJECT_FAULT": "swap_block_tables:0.1,inflate_computed:1", "KVFENCE_FAULT_SEED": "31"}
SWAPPED = "fault swap_block_tables swapped"
INFLATED = "fault inflate_computed moved the start of "
ABORTED = "kvfence-vllm: aborted request"
LONG = "long"
PROMPTS = {
    LONG: "Write a long story about a lighthouse keeper named Tom who finds a message in a bottle at dawn.",
    "count": "Count from one to twenty in words: one, two, three,",
    "fruit": "Here is a list of fruits, one per line:\n1. Apple\n2.",
}
MAX_TOKENS = {LONG: 160, "count": 32, "fruit": 32}


@contextmanager
def served(extra: Sequence[str], env: Mapping[str, str]) -> Iterator[Peer]:
    with vllm_server(Path(SERVE), [*BASE, *extra], env, START_TIMEOUT_S) as peer:
        yield peer


@contextmanager
def served_with_faults(fence: str) -> Iterator[Peer]:
    """A server of the two tenants with FAULT armed and the fence `fence` ("on" or "off"), ready for
    `scenario`: it holds vLLM's scheduler while its requests arrive (the dev server's /pause?mode=keep
    and /resume) and reads their arrival on the log (--enable-log-requests: "Added request ID.")."""
    env = {**FAULT, "KVFENCE_FENCE": fence, "VLLM_SERVER_DEV_MODE": "1"}
    with served(["--api-key", *KEYS, "--enable-log-requests"], env) as peer:
        yield peer


@dataclass(frozen=True)
class Answer:
    status: int  # 200, or the error's status (an error event inside a 200 stream reads as 500)
    text: str
    error: str | None = None  # the OpenAI error's type


def headers(key: str | None, request_id: str | None = None) -> dict[str, str]:
    """The key's bearer header, and `request_id` as vLLM's X-Request-Id: its log then names the request
    cmpl-REQUEST_ID-0-..."""
    return ({"Authorization": f"Bearer {key}"} if key else {}) | (
        {"X-Request-Id": request_id} if request_id else {}
    )


def ask(url: str, name: str, key: str | None, request_id: str | None = None) -> Answer:
    body = {"model": VLLM_MODEL, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name], "temperature": 0}
    return complete(url, {**body, "ignore_eos": True}, key, request_id=request_id)


def complete(
    url: str, body: Mapping[str, object], key: str | None, timeout: float = 600, request_id: str | None = None
) -> Answer:
    reply = httpx.post(
        f"{url}/v1/completions", json=dict(body), headers=headers(key, request_id), timeout=timeout
    )
    if reply.status_code != 200:
        return Answer(reply.status_code, "", reply.json()["error"]["type"])
    return Answer(200, reply.json()["choices"][0]["text"])


def stream(url: str, name: str, key: str | None, request_id: str) -> Answer:
    body = {"model": VLLM_MODEL, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name], "temperature": 0}
    body = {**body, "ignore_eos": True, "stream": True}
    text, sent = "", headers(key, request_id)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=sent, timeout=600) as reply:
        if reply.status_code != 200:
            return Answer(reply.status_code, "", json.loads(reply.read())["error"]["type"])
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return Answer(500, text, chunk["error"]["type"])
            text += chunk["choices"][0]["text"]
    return Answer(200, text)


def scenario(peer: Peer, key: str | None = KEYS[0]) -> tuple[dict[str, Answer], dict[str, Answer]]:
    """(references asked alone, answers asked together). Each prompt alone first (one running request:
    no fault fires). Then, with the scheduler held, the long request (streamed), and the others one by one
    once vLLM logs the one before added; then the scheduler resumes. So the three prefill in one step, the
    long one in the first row, and decode side by side from the next: the order is the engine's, whatever
    the machine's load (this client never races its steps). Each asked together is logged as
    cmpl-together-NAME-0-... (`named`)."""
    references = {name: ask(peer.url, name, key) for name in PROMPTS}
    assert all(a.status == 200 and a.text for a in references.values()), references
    together: dict[str, Answer] = {}

    def run(name: str) -> None:
        rid = f"together-{name}"
        together[name] = stream(peer.url, name, key, rid) if name == LONG else ask(peer.url, name, key, rid)

    threads = [threading.Thread(target=run, args=(name,)) for name in PROMPTS]  # the long one first
    scheduler(peer, "pause", key)
    for thread, name in zip(threads, PROMPTS, strict=True):
        thread.start()
        added(peer, f"cmpl-together-{name}-")
    scheduler(peer, "resume", key)
    for thread in threads:
        thread.join(600)
    return references, together


def scheduler(peer: Peer, action: str, key: str | None) -> None:
    """Hold vLLM's scheduler (`pause`: requests kept, no step taken) or let it go (`resume`)."""
    params = {"mode": "keep"} if action == "pause" else {}
    reply = httpx.post(f"{peer.url}/{action}", params=params, headers=headers(key), timeout=600)
    assert reply.status_code == 200, (action, reply.status_code, reply.text)


def added(peer: Peer, prefix: str, timeout_s: float = 600) -> None:
    """Wait until vLLM's log says a request whose id starts with `prefix` reached its engine."""
    deadline = time.monotonic() + timeout_s
    while not trail(peer, f"Added request {prefix}"):
        assert time.monotonic() < deadline, f"vLLM never added {prefix}"
        time.sleep(0.1)


def named(line: str, after: str) -> str:
    """The request id a trail line names right after `after`."""
    return line.split(after, 1)[1].split()[0]


def trail(peer: Peer, phrase: str) -> list[str]:
    assert peer.log is not None
    return [line for line in Path(peer.log).read_text().splitlines() if phrase in line]


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
