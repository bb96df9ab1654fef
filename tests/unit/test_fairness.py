"""One tenant cannot starve, flush or crowd out another: fair admission, per-tenant queue and running
limits, preemption from the tenant over its share, and a per-tenant audit ring. Tiny model, engine level.
"""

from __future__ import annotations

import random

import pytest
from conftest import make_engine

from kvfence.engine.engine import RATE_LIMIT_EXCEEDED, AdmissionError, LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams
from kvfence.trail.events import EventLog

_rng = random.Random(5)
LONG = SamplingParams(max_tokens=4, ignore_eos=True)


def prompt(n: int) -> list[int]:
    return [_rng.randrange(256) for _ in range(n)]


def steps_until_first_token(engine: LLMEngine, request: Request, limit: int = 500) -> int:
    for step in range(1, limit):
        engine.step()
        if request.output_token_ids:
            return step
    raise AssertionError("no first token")


FLOOD = [prompt(40) for _ in range(16)]
LATECOMER = prompt(12)


def flood_then_one(model: Transformer, fair: bool) -> tuple[int, list[Request]]:
    """Tenant A queues 16 long prompts; tenant B then sends one: how many steps until B's first token."""
    settings = {"num_pages": 256, "max_model_len": 48, "max_num_batched_tokens": 48, "max_num_seqs": 8}
    engine = make_engine(model, fair_scheduling=fair, **settings)
    flood = [engine.add_request(p, LONG, "A") for p in FLOOD]
    engine.step()
    b = engine.add_request(LATECOMER, LONG, "B")
    steps = steps_until_first_token(engine, b)
    while engine.has_unfinished():
        engine.step()
    return steps, [*flood, b]


def test_a_flooding_tenant_does_not_starve_another(tiny: Transformer) -> None:
    fair_steps, fair = flood_then_one(tiny, fair=True)
    fifo_steps, fifo = flood_then_one(tiny, fair=False)
    assert fair_steps <= 3, f"B waited {fair_steps} steps behind A's flood"
    assert fifo_steps > 3 * fair_steps, "arrival order should have made B wait (the comparison is void)"
    for requests in (fair, fifo):  # A still completes every request, with the same tokens either way
        assert all(r.status is Status.FINISHED and len(r.output_token_ids) == 4 for r in requests)
    assert [r.output_token_ids for r in fair] == [r.output_token_ids for r in fifo]


def test_beyond_its_queue_limit_a_tenant_gets_429(tiny: Transformer) -> None:
    engine = make_engine(tiny, max_waiting_per_tenant=3)
    for _ in range(3):
        engine.add_request(prompt(8), LONG, "A")
    generations = engine.pool.generation.copy()
    with pytest.raises(AdmissionError) as err:
        engine.add_request(prompt(8), LONG, "A")
    assert (err.value.code, err.value.status) == (RATE_LIMIT_EXCEEDED, 429)
    assert (engine.pool.generation == generations).all(), "a refused request moved a page"
    engine.add_request(prompt(8), LONG, "B")  # another tenant is not limited by A's queue


def test_a_tenant_at_its_running_limit_waits_while_others_start(tiny: Transformer) -> None:
    engine = make_engine(tiny, max_running_per_tenant=2, max_num_seqs=8)
    a = [engine.add_request(prompt(8), LONG, "A") for _ in range(4)]
    b = engine.add_request(prompt(8), LONG, "B")
    engine.step()
    running = [r for r in engine.scheduler.running]
    assert sum(r.tenant == "A" for r in running) == 2 and b in running
    while engine.has_unfinished():
        engine.step()
        assert sum(r.tenant == "A" for r in engine.scheduler.running) <= 2
    assert all(r.status is Status.FINISHED for r in [*a, b])


def test_preemption_takes_from_the_tenant_over_its_share(tiny: Transformer) -> None:
    """Pages run out while both tenants decode: the victim is one of A's requests, never B's, though B's
    is the most recently admitted (the victim a tenant-blind scheduler would take)."""
    engine = make_engine(tiny, num_pages=12, max_model_len=48, page_size=4, max_num_seqs=8)
    long = SamplingParams(max_tokens=10, ignore_eos=True)
    a = [engine.add_request(prompt(7), long, "A") for _ in range(3)]
    engine.step()
    b = engine.add_request(prompt(7), long, "B")
    engine.step()
    assert engine.scheduler.running[-1] is b
    while engine.has_unfinished():
        engine.step()
    assert b.num_preemptions == 0 and sum(r.num_preemptions for r in a) >= 1
    assert all(r.status is Status.FINISHED for r in [*a, b])


def test_one_tenant_cannot_flush_another_tenants_trails() -> None:
    events = EventLog(max_requests=3)
    for i in range(2):
        events.emit(f"a{i}", "admitted", tenant="A")
        events.emit(f"a{i}", "finished", reason="stop")
    for i in range(50):  # B floods with requests that are refused at admission
        events.emit(f"b{i}", "rejected", reason="context_length_exceeded", tenant="B")
    assert events.kinds("a0") == ["admitted", "finished"] and events.kinds("a1") == ["admitted", "finished"]
    assert [rid for rid in events.request_ids() if rid.startswith("b")] == ["b47", "b48", "b49"]


def test_rejected_requests_count_against_their_own_tenant(tiny: Transformer) -> None:
    engine = make_engine(tiny)
    engine.events = engine.scheduler.events = engine.kv_cache.events = EventLog(max_requests=2)
    kept = engine.add_request(prompt(8), LONG, "A")
    for i in range(5):
        with pytest.raises(AdmissionError):
            engine.add_request(prompt(60), LONG, "B", request_id=f"big{i}")
    assert engine.events.kinds(kept.request_id) == ["admitted"]
    assert engine.events.for_request("big4")[0]["tenant"] == "B"


def test_a_light_tenant_keeps_its_place_while_its_last_request_decodes(tiny: Transformer) -> None:
    """B sends its next request while its previous one still decodes: B is not idle, so it keeps its
    small share of tokens served and goes ahead of A's flood (it must not be levelled up to A's share
    as a tenant back from idle would be)."""
    settings = {"num_pages": 256, "max_model_len": 48, "max_num_batched_tokens": 48, "max_num_seqs": 8}
    engine = make_engine(tiny, **settings)
    for p in FLOOD:
        engine.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True), "A")
    first = engine.add_request(LATECOMER, SamplingParams(max_tokens=8, ignore_eos=True), "B")
    steps_until_first_token(engine, first)
    again = engine.add_request(prompt(12), LONG, "B")
    assert not first.is_finished, "the scenario needs B's first request still decoding"
    assert steps_until_first_token(engine, again) == 1  # its whole prompt in the very next step
