"""Where the router sends a request (disagg/placement.py), without a socket: the pair with the most headroom,
pools compared alone and never summed, lost workers skipped, a lost role a 503 — each refusal before
anything is taken."""

from __future__ import annotations

import pytest

from kvfence.disagg.placement import Placement, WorkerInfo
from kvfence.engine.engine import AdmissionError


def placement_of(decode_capacities: list[int], prefill_capacity: int = 1000) -> Placement:
    """Two prefill workers and one decode worker per capacity, as their hellos would describe them."""
    addresses = {"prefill": ["p0", "p1"], "decode": [f"d{i}" for i in range(len(decode_capacities))]}
    names = {a: f"{role}-{i}" for role, group in addresses.items() for i, a in enumerate(group)}
    placement = Placement(addresses, names, isolation=True)
    capacities = [prefill_capacity, prefill_capacity, *decode_capacities]
    for address, capacity in zip([*addresses["prefill"], *addresses["decode"]], capacities, strict=True):
        placement.workers[names[address]] = WorkerInfo(
            names[address].partition("-")[0], capacity, 1000, 4, True, {}
        )
    placement.max_model_len = placement.window()
    return placement


def pair(placement: Placement, prompt: int, budget: int) -> tuple[str, str]:
    route = placement.choose(prompt, budget)
    placement.take(f"r{sum(placement.routed.values()) // 2}", route)
    return placement.names[route.prefill], placement.names[route.decode]


def test_the_pair_with_the_most_headroom_is_chosen() -> None:
    placement = placement_of([200, 200])
    assert pair(placement, 10, 90) == ("prefill-0", "decode-0")  # a tie: the first listed
    assert pair(placement, 10, 10) == ("prefill-1", "decode-1")
    assert pair(placement, 10, 10) == ("prefill-0", "decode-1")  # decode-1 has 180 left, decode-0 100
    placement.release("r0", placement.routes["r0"])
    assert pair(placement, 10, 10) == ("prefill-0", "decode-0")  # r0 ended: decode-0 has 200 again


def test_a_pool_is_compared_alone_never_summed() -> None:
    placement = placement_of([100, 100])
    with pytest.raises(AdmissionError, match="decode KV pool holds 100 tokens") as refused:
        placement.choose(50, 60)  # 110 tokens: less than the two pools together, more than either
    assert refused.value.code == "context_length_exceeded" and refused.value.status == 400
    assert placement.routes == {} and not placement.load  # refused before anything was taken
    assert pair(placement_of([100, 300]), 50, 60) == ("prefill-0", "decode-1")  # only the pool that holds it


def test_a_lost_worker_is_skipped_and_a_lost_role_answers_503() -> None:
    placement = placement_of([200, 200])
    placement.down.add("d0")
    assert pair(placement, 10, 10)[1] == "decode-1"
    placement.down.add("d1")
    with pytest.raises(AdmissionError) as refused:
        placement.choose(10, 10)
    assert (refused.value.code, refused.value.status) == ("decode_unavailable", 503)


def test_workers_whose_pools_hold_another_kv_dtype_cannot_serve_together() -> None:
    """A page moves as bytes: a float32 page read as float16 slots would be other values (the decode
    worker's length check would abort each request; the router refuses the pair before any)."""
    placement = placement_of([200])
    assert placement.mismatch() is None
    for name, worker in placement.workers.items():
        worker.info["kv_cache_dtype"] = "float16" if name == "decode-0" else "float32"
    assert placement.mismatch() == "KV dtypes differ: prefill-0 float32, prefill-1 float32, decode-0 float16"


def test_a_reconnected_worker_is_adopted_with_its_new_pool_unless_it_cannot_serve_beside_the_others() -> None:
    """A restarted decode worker with a smaller window becomes admission's window; one whose pool holds
    another KV dtype is refused by name and the worker it replaced stays as it was."""
    placement = placement_of([200])
    smaller = WorkerInfo("decode", 200, 500, 4, True, {})
    assert placement.adopt("decode-0", smaller) is None
    assert placement.workers["decode-0"] is smaller and placement.max_model_len == 500
    other = WorkerInfo("decode", 400, 800, 4, True, {"kv_cache_dtype": "float16"})
    for worker in placement.workers.values():
        worker.info["kv_cache_dtype"] = "float32"
    assert placement.adopt("decode-0", other) == (
        "KV dtypes differ: prefill-0 float32, prefill-1 float32, decode-0 float16"
    )
    assert placement.workers["decode-0"] is smaller and placement.max_model_len == 500


def test_a_worker_that_takes_no_kv_is_skipped_until_its_next_hello() -> None:
    """A worker whose landing process gave up (it refused with kv_unavailable): nothing more is placed on
    it, /health names it with its reason, and a role with no worker that takes KV answers 503."""
    placement = placement_of([200, 200])
    placement.no_kv["d0"] = "its landing process failed"
    assert pair(placement, 10, 10)[1] == "decode-1" and pair(placement, 10, 10)[1] == "decode-1"
    placement.down.add("d1")
    assert placement.health() == {
        "prefill-0": "up",
        "prefill-1": "up",
        "decode-0": "its landing process failed",
        "decode-1": "down",
    }
    with pytest.raises(AdmissionError) as refused:
        placement.choose(10, 10)
    assert (refused.value.code, refused.value.status) == ("decode_unavailable", 503)
