"""The vLLM plugin with its fence on and the same faults armed (plugin_peer.FAULT), inside a real `vllm
serve` (CPU, SmolLM2): the swapped requests end in a 500 `kv_integrity_error` (an error event on a
stream), and so does the request whose start moved ahead of its written KV (unwritten_read); the trail
(vLLM's log) names each, every 200 is the request's own, and `kvfence audit --black-box` PASSES the
server, every check, with the swap still firing. One server for both checks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from plugin_peer import (
    ABORTED,
    INFLATED,
    KEYS,
    LONG,
    SWAPPED,
    ask,
    named,
    needs_vllm,
    scenario,
    served_with_faults,
    trail,
)

from kvfence.audit.black_box import audit_black_box
from kvfence.harness.peers import Peer

pytestmark = needs_vllm


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    with served_with_faults("on") as peer:
        yield peer


def test_the_swapped_requests_end_in_an_integrity_error_and_every_200_is_their_own(peer: Peer) -> None:
    references, together = scenario(peer)
    swaps, aborts = trail(peer, SWAPPED), trail(peer, ABORTED)
    after = ask(peer.url, "count", KEYS[0])  # the server goes on serving
    failed = [name for name, a in together.items() if a.status != 200]
    print(f"fence on: {len(swaps)} swaps; {aborts}; answers {together}")
    assert swaps and failed and len(aborts) >= len(failed), (swaps, aborts, together)
    for name in failed:  # what a stream got before its error was its own text
        answer = together[name]
        assert answer.status == 500 and answer.error == "kv_integrity_error", (name, answer)
        assert references[name].text.startswith(answer.text), name
    for name, answer in together.items():
        if answer.status == 200:
            assert answer.text == references[name].text, name
    assert after == references["count"]
    # The long request's start moved a block ahead once: it aborts as reading unwritten KV, that alone.
    inflated = trail(peer, INFLATED)
    moved = named(inflated[0], INFLATED) if len(inflated) == 1 else ""
    assert moved.startswith(f"cmpl-together-{LONG}-"), inflated
    lines = [line for line in aborts if f"{ABORTED} {moved}:" in line]
    assert len(lines) == 1 and f"{moved}: unwritten_read" in lines[0], aborts
    assert together[LONG].status == 500 and together[LONG].error == "kv_integrity_error"


def test_the_black_box_audit_passes_the_server_with_the_fault_firing(peer: Peer) -> None:
    swaps_before = len(trail(peer, SWAPPED))
    result = audit_black_box(peer.url, KEYS)
    swaps = len(trail(peer, SWAPPED)) - swaps_before
    print(
        f"fence on: audit exit {result['exit']}, {result['checks']}, {swaps} swaps in it; {result['replay']}"
    )
    assert swaps > 0 and result["replay"]["integrity_aborts"] > 0, result  # the fault fired, the fence held
    assert result["exit"] == 0 and set(result["checks"].values()) == {"PASS"}, result
