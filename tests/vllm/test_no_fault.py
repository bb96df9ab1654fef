"""The vLLM plugin with its fence on and no fault, inside a real `vllm serve` (CPU, SmolLM2), on one server
(module-scoped) whose 12-block pool four long requests outgrow, prefills in chunks of 64 tokens, and
tenants from a keys file (`KVFENCE_TENANT_KEYS`: two keys of tenant alice, one of bob):
- prefix hits, chunked prefill and preemption raise no false abort, and answers together equal alone;
- prefix-cache hits stay inside a tenant: the same prompt hits for alice's second key, never for bob,
  and bob's `cache_salt` (alice's name, or the plugin's own salt for her) reaches none of alice's blocks;
- the pool vs the window: the start-up line says what the pool holds for the window, and a pool that
  cannot hold one request's window is refused at start, in one line (vLLM's own check; the plugin does not
  run without it).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator

import pytest
from plugin_peer import (
    ABORTED,
    BASE,
    SERVE,
    START_TIMEOUT_S,
    Answer,
    complete,
    metric,
    needs_vllm,
    served,
    trail,
)

from kvfence.harness.key_files import write_key_file
from kvfence.harness.peers import VLLM_MODEL, Peer, free_port

pytestmark = needs_vllm
ALICE, ALICE_2, BOB = "sk-alice-1", "sk-alice-2", "sk-bob"
HITS = "vllm:prefix_cache_hits_total"
POOL = ["--num-gpu-blocks-override", "12", "--max-num-batched-tokens", "64"]


def test_a_pool_that_cannot_hold_one_requests_window_is_refused_at_start() -> None:
    """4 blocks (3 besides the null block) for a 1,024-token window: vLLM exits before it serves, its
    reason on one line of its log. First in the module, before its server starts."""
    command = ["bash", SERVE, str(free_port()), *BASE, "--num-gpu-blocks-override", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=START_TIMEOUT_S)
    reasons = [line for line in done.stdout.splitlines() + done.stderr.splitlines() if "max seq len" in line]
    print(f"refused: exit {done.returncode}: {reasons[-1:]}")
    assert done.returncode != 0 and reasons
    assert "To serve at least one request with the model's max seq len (1024)" in reasons[-1]


@pytest.fixture(scope="module")
def peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Peer]:
    keys = write_key_file(
        tmp_path_factory.mktemp("keys") / "tenants", [f"{ALICE} alice", f"{ALICE_2} alice", f"{BOB} bob"]
    )
    with served(POOL, {"KVFENCE_TENANT_KEYS": str(keys)}) as peer:
        yield peer


PREAMBLE = " ".join(
    f"Rule {n}: keep the lighthouse lamp clean, log the ships, and sound the horn in fog." for n in range(16)
)
QUESTIONS = [
    "What is rule 3?",
    "Summarise the rules.",
    "Which rule mentions fog?",
    "Write a poem about rule 7.",
]


def test_prefix_hits_chunked_prefill_and_a_small_pool_raise_no_false_abort(peer: Peer) -> None:
    """A shared preamble of several blocks (prefix-cache hits), prefills split into chunks of 64 tokens,
    and a pool of 12 blocks that four such requests outgrow (vLLM preempts when it must): every answer
    together equals the one asked alone, and the fence aborts nothing."""
    body = {"model": VLLM_MODEL, "max_tokens": 256, "temperature": 0, "ignore_eos": True}

    def one(question: str) -> Answer:
        return complete(peer.url, {**body, "prompt": PREAMBLE + question}, ALICE, timeout=900)

    references = [one(q) for q in QUESTIONS]
    together: list[Answer | None] = [None] * len(QUESTIONS)

    def run(index: int) -> None:
        together[index] = one(QUESTIONS[index])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(QUESTIONS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
    hits, preemptions = metric(peer.url, HITS), metric(peer.url, "vllm:num_preemptions_total")
    aborts = trail(peer, ABORTED)
    print(f"no fault: {hits:.0f} prefix-cache hit tokens, {preemptions:.0f} preemptions, aborts {aborts}")
    assert hits > 0 and not aborts
    assert all(a.status == 200 for a in references) and together == references


TENANT_PROMPT = " ".join(
    f"Ledger line {n}: the harbour master logged {n * 7} crates of tea." for n in range(24)
)


def hits_for(peer: Peer, key: str, salt: str | None = None) -> float:
    """The prefix-cache hit tokens one request of TENANT_PROMPT brought (requests here run one at a time)."""
    body: dict[str, object] = {
        "model": VLLM_MODEL,
        "prompt": TENANT_PROMPT,
        "max_tokens": 4,
        "temperature": 0,
    }
    if salt is not None:
        body["cache_salt"] = salt
    before = metric(peer.url, HITS)
    answer = complete(peer.url, body, key)
    assert answer.status == 200, answer
    return metric(peer.url, HITS) - before


def test_prefix_cache_hits_stay_inside_a_tenant_whatever_salt_a_client_sends(peer: Peer) -> None:
    """Each of bob's tries is followed by alice's second key, whose hit shows her blocks were cached while
    bob asked (bob's request cannot have put them back): what bob missed was there to hit."""
    cold = hits_for(peer, ALICE)
    tries = [
        (hits_for(peer, BOB, salt), hits_for(peer, ALICE_2)) for salt in (None, "alice", "kvfence:alice")
    ]
    print(f"tenants: alice cold {cold:.0f} hit tokens; (bob, alice's second key) after each: {tries}")
    assert cold == 0 and all(bob == 0 and alice > 0 for bob, alice in tries), tries
    unknown = complete(peer.url, {"model": VLLM_MODEL, "prompt": "Hi", "max_tokens": 1}, "sk-nobody")
    assert unknown.status == 401 and unknown.error == "authentication_error"


def test_the_start_up_line_gives_the_pool_against_the_window(peer: Peer) -> None:
    lines = trail(peer, "kvfence-vllm: 12 blocks of")
    assert len(lines) == 1 and "for a window of 1024 tokens, fence on" in lines[0], lines
