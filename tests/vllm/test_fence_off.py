"""The vLLM plugin with its fence off and the faults `swap_block_tables` and `inflate_computed` armed
(plugin_peer.FAULT), inside a real `vllm serve` (CPU, SmolLM2): the swapped requests answer 200 with text
that is not theirs, the request whose start moved ahead of its written KV answers 200 with text that is
not its answer alone, and `kvfence audit --black-box` FAILS the server. One server for all checks
(module-scoped)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from plugin_peer import (
    ABORTED,
    INFLATED,
    KEYS,
    LONG,
    SWAPPED,
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
    with served_with_faults("off") as peer:
        yield peer


def test_the_swapped_rows_leak_into_200s(peer: Peer) -> None:
    references, together = scenario(peer)
    swaps, aborts = trail(peer, SWAPPED), trail(peer, ABORTED)
    print(f"fence off: {len(swaps)} swaps; answers {together}; references {references}")
    assert swaps and not aborts
    assert all(a.status == 200 for a in together.values()), together
    leaked = [name for name, a in together.items() if a.text != references[name].text]
    assert leaked, "the fault fired but every answer was its own"
    # The long request's start moved a block ahead once (and it was never swapped): its 200 read KV no
    # step wrote for it, and differs from its answer alone.
    inflated = trail(peer, INFLATED)
    print(f"fence off: {inflated}")
    assert len(inflated) == 1 and named(inflated[0], INFLATED).startswith(f"cmpl-together-{LONG}-"), inflated
    assert not [line for line in swaps if named(inflated[0], INFLATED) in line], swaps
    assert together[LONG].status == 200 and together[LONG].text != references[LONG].text


def test_the_black_box_audit_fails_the_server(peer: Peer) -> None:
    result = audit_black_box(peer.url, KEYS)
    print(f"fence off: audit exit {result['exit']}, {result['checks']}; replay: {result['replay_details']}")
    assert trail(peer, SWAPPED) and not trail(peer, ABORTED)
    assert result["exit"] == 1 and result["checks"]["replay"] == "FAIL", result
