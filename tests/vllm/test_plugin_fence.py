"""The vLLM plugin (plugins/vllm) inside a real `vllm serve` (vLLM's CPU build, SmolLM2, issue 62), with the
fault `swap_block_tables:1` (before every step with two running requests, two of them trade block-table
rows in the worker): with the fence off the swapped requests answer 200 with text that is not theirs;
with it on they end in an error, the trail (vLLM's log) names each, and every 200 is the request's own.

`make test-vllm` runs these: it builds vLLM's environment with the peers script, layers the plugin over
it (plugins/vllm/overlay-env.sh) and names the serve script in $KVFENCE_TEST_VLLM. Elsewhere they skip.
Each scenario first asks each prompt alone (one running request: the fault cannot fire) for the
reference, then starts the long request, waits until it is streaming, and sends the others beside it.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvfence.harness.peers import VLLM_MODEL, Peer, vllm_server

SERVE = os.environ.get("KVFENCE_TEST_VLLM", "")
pytestmark = pytest.mark.skipif(not SERVE, reason="vLLM's CPU build and the plugin: `make test-vllm`")
START_TIMEOUT_S = 900.0  # a busy 2-core machine; its first start also compiles the model
FAULT = {"KVFENCE_INJECT_FAULT": "swap_block_tables:1"}
EAGER = ["--optimization-level", "0"]  # no torch.compile: minutes less per start, the same block tables
LONG = "long"
PROMPTS = {
    LONG: "Write a long story about a lighthouse keeper named Tom who finds a message in a bottle.",
    "count": "Count from one to twenty in words: one, two, three,",
    "fruit": "Here is a list of fruits, one per line:\n1. Apple\n2.",
}
MAX_TOKENS = {LONG: 160, "count": 32, "fruit": 32}


@dataclass(frozen=True)
class Answer:
    status: int  # 200, or the error's status (an error event inside a 200 stream reads as 500)
    text: str


def ask(url: str, name: str) -> Answer:
    body = {"model": VLLM_MODEL, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name], "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json={**body, "ignore_eos": True}, timeout=600)
    if reply.status_code != 200:
        return Answer(reply.status_code, "")
    return Answer(200, reply.json()["choices"][0]["text"])


def stream(url: str, name: str, started: threading.Event) -> Answer:
    body = {"model": VLLM_MODEL, "prompt": PROMPTS[name], "max_tokens": MAX_TOKENS[name], "temperature": 0}
    text, status = "", 200
    with httpx.stream(
        "POST", f"{url}/v1/completions", json={**body, "ignore_eos": True, "stream": True}, timeout=600
    ) as reply:
        if reply.status_code != 200:
            started.set()
            return Answer(reply.status_code, "")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                status = 500
                break
            text += chunk["choices"][0]["text"]
            if text:
                started.set()
    started.set()
    return Answer(status, text)


def scenario(peer: Peer) -> tuple[dict[str, Answer], dict[str, Answer]]:
    """(references asked alone, answers asked together)."""
    references = {name: ask(peer.url, name) for name in PROMPTS}
    assert all(a.status == 200 and a.text for a in references.values()), references
    together: dict[str, Answer] = {}
    started = threading.Event()

    def run(name: str) -> None:
        together[name] = stream(peer.url, name, started) if name == LONG else ask(peer.url, name)

    threads = [threading.Thread(target=run, args=(LONG,))]
    threads[0].start()
    assert started.wait(600)  # the long request is running: the others join its batch
    threads += [threading.Thread(target=run, args=(name,)) for name in PROMPTS if name != LONG]
    for thread in threads[1:]:
        thread.start()
    for thread in threads:
        thread.join(600)
    return references, together


def trail(peer: Peer, phrase: str) -> list[str]:
    assert peer.log is not None
    return [line for line in Path(peer.log).read_text().splitlines() if phrase in line]


def test_with_the_fence_off_the_swapped_rows_leak_into_200s() -> None:
    with vllm_server(
        Path(SERVE), env={**FAULT, "KVFENCE_FENCE": "off"}, start_timeout_s=START_TIMEOUT_S
    ) as peer:
        references, together = scenario(peer)
        swaps = trail(peer, "fault swap_block_tables swapped")
        aborts = trail(peer, "kvfence-vllm: aborted request")
    print(f"fence off: {len(swaps)} swaps; answers {together}; references {references}")
    assert swaps and not aborts
    assert all(a.status == 200 for a in together.values()), together
    leaked = [name for name, a in together.items() if a.text != references[name].text]
    assert leaked, "the fault fired but every answer was its own"


def test_with_the_fence_on_the_swapped_requests_end_in_an_error_and_every_200_is_their_own() -> None:
    with vllm_server(Path(SERVE), EAGER, FAULT, START_TIMEOUT_S) as peer:
        references, together = scenario(peer)
        swaps = trail(peer, "fault swap_block_tables swapped")
        aborts = trail(peer, "kvfence-vllm: aborted request")
        after = ask(peer.url, "count")  # the server goes on serving
    failed = [name for name, a in together.items() if a.status != 200]
    print(f"fence on: {len(swaps)} swaps; {aborts}; answers {together}")
    assert swaps and failed and len(aborts) >= len(failed), (swaps, aborts, together)
    for name in failed:  # what a stream got before its error was its own text
        assert together[name].status >= 500 and references[name].text.startswith(together[name].text), name
    for name, answer in together.items():
        if answer.status == 200:
            assert answer.text == references[name].text, name
    assert after == references["count"]


PREAMBLE = " ".join(
    f"Rule {n}: keep the lighthouse lamp clean, log the ships, and sound the horn in fog." for n in range(16)
)
QUESTIONS = [
    "What is rule 3?",
    "Summarise the rules.",
    "Which rule mentions fog?",
    "Write a poem about rule 7.",
]


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))


def test_without_a_fault_prefix_hits_chunked_prefill_and_a_small_pool_raise_no_false_abort() -> None:
    """A shared preamble of several blocks (prefix-cache hits), prefills split into chunks of 64 tokens,
    and a pool of 12 blocks that four such requests outgrow (vLLM preempts when it must): every answer
    together equals the one asked alone, and the fence aborts nothing."""
    extra = [
        *EAGER,
        "--max-model-len",
        "1024",
        "--num-gpu-blocks-override",
        "12",
        "--max-num-batched-tokens",
        "64",
    ]
    with vllm_server(Path(SERVE), extra=extra, start_timeout_s=START_TIMEOUT_S) as peer:
        body = {"model": VLLM_MODEL, "max_tokens": 256, "temperature": 0, "ignore_eos": True}

        def one(question: str) -> Answer:
            reply = httpx.post(
                f"{peer.url}/v1/completions", json={**body, "prompt": PREAMBLE + question}, timeout=900
            )
            return Answer(
                reply.status_code, reply.json()["choices"][0]["text"] if reply.status_code == 200 else ""
            )

        references = [one(q) for q in QUESTIONS]
        together: list[Answer | None] = [None] * len(QUESTIONS)

        def run(index: int) -> None:
            together[index] = one(QUESTIONS[index])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(900)
        hits, preemptions = (
            metric(peer.url, "vllm:prefix_cache_hits_total"),
            metric(peer.url, "vllm:num_preemptions_total"),
        )
        aborts = trail(peer, "kvfence-vllm: aborted request")
    print(f"no fault: {hits:.0f} prefix-cache hit tokens, {preemptions:.0f} preemptions, aborts {aborts}")
    assert hits > 0 and not aborts
    assert all(a.status == 200 for a in references) and together == references
