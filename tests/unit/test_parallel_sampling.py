"""Parallel sampling (n > 1) on the tiny model: the prompt computed once, then forked into requests that
share its full pages by reference and each copy its partial last page, without changing any numerics."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from conftest import make_engine

from kvfence.engine.engine import (
    CONTEXT_LENGTH_EXCEEDED,
    DUPLICATE_REQUEST_ID,
    FORKED,
    AdmissionError,
    LLMEngine,
)
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status, fork_id
from kvfence.sampling import SamplingParams

_rng = random.Random(15)
PAGE = 4
PROMPT = [_rng.randrange(256) for _ in range(10)]  # two full pages and two slots of a third
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=41, ignore_eos=True)


def with_seed(params: SamplingParams, index: int) -> SamplingParams:
    """What fork `index` samples with: the parent's parameters, its seed + index."""
    return dataclasses.replace(params, seed=None if params.seed is None else params.seed + index)


def run_until_forked(engine: LLMEngine, parent: Request) -> None:
    while not parent.is_finished:
        engine.step()


def run_all(engine: LLMEngine, requests: list[Request]) -> None:
    while not all(r.is_finished for r in requests):
        engine.step()


def solo(model: Transformer, params: SamplingParams) -> list[int]:
    return make_engine(model).generate([PROMPT], params)[0].output_token_ids


def test_forks_share_full_pages_and_copy_the_partial_one(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE)
    parent = engine.add_request(PROMPT, SEEDED, "a", request_id="p", n=3)
    run_until_forked(engine, parent)
    assert (parent.status, parent.finish_reason) == (Status.FINISHED, FORKED)
    forked = next(e for e in engine.events.for_request("p") if e["kind"] == "forked")
    shared, source = forked["shared"], forked["source"]
    assert forked["children"] == [fork_id("p", i) for i in range(3)] == [c.request_id for c in parent.forks]
    pool, refcount = engine.pool, engine.allocator.refcount
    assert len(shared) == 2 and refcount[shared].tolist() == [3, 3]  # the parent's reference is gone
    copies = [child.record.pages[2] for child in parent.forks]
    assert len(set(copies)) == 3 and source not in copies and forked["copies"] == copies
    for child in parent.forks:
        record = child.record
        assert list(record.pages[:2]) == shared
        assert list(record.generations[:2]) == pool.generation[shared].tolist()
        assert record.generations[2] == pool.generation[record.pages[2]] and refcount[record.pages[2]] == 1
        copy = record.pages[2]
        # The source page is free now but never zeroed: what the copy took from it is still there.
        assert torch.equal(pool.kv[:, :, copy, :2], pool.kv[:, :, source, :2]) and pool.written[copy] == 2
        trail = engine.events.for_request(child.request_id)
        assert trail[0]["kind"] == "forked" and trail[0]["tenant"] == "a" and trail[0]["parent"] == "p"
        assert trail[0]["shared"] == shared and trail[0]["copied"] == [copy]
    assert engine.events.kinds("p")[-3:] == ["forked", "released", "finished"]
    run_all(engine, parent.forks)
    assert engine.allocator.num_free_pages == pool.num_pages
    engine.check_integrity()


def test_a_prompt_ending_on_a_page_boundary_copies_nothing(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE)
    parent = engine.add_request(PROMPT[:8], SEEDED, "a", request_id="p", n=2)
    run_until_forked(engine, parent)
    forked = next(e for e in engine.events.for_request("p") if e["kind"] == "forked")
    assert forked["source"] is None and forked["copies"] == [] and len(forked["shared"]) == 2
    run_all(engine, parent.forks)
    assert engine.allocator.num_free_pages == engine.pool.num_pages


@pytest.mark.parametrize("params", [SEEDED, SamplingParams(max_tokens=8, ignore_eos=True)])
def test_each_fork_samples_what_a_solo_request_with_its_seed_does(
    tiny: Transformer, params: SamplingParams
) -> None:
    engine = make_engine(tiny, page_size=PAGE)
    parent = engine.add_request(PROMPT, params, "a", n=3)
    run_all(engine, [parent, *parent.forks])
    for index, child in enumerate(parent.forks):
        alone = solo(tiny, with_seed(params, index))
        assert child.output_token_ids == alone and child.status is Status.FINISHED
    assert engine.prefix is not None and engine.prefix.hits == 0  # shared by the fork, not by the cache
    outputs = [c.output_token_ids for c in parent.forks]
    assert (len({tuple(o) for o in outputs}) == 1) == (params.seed is None)  # greedy forks agree


def test_aborting_one_fork_leaves_the_others_alone(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE)
    parent = engine.add_request(PROMPT, SEEDED, "a", n=3)
    run_until_forked(engine, parent)
    engine.step()
    assert engine.abort(fork_id(parent.request_id, 1)) is not None
    run_all(engine, parent.forks)
    first, aborted, last = parent.forks
    assert aborted.status is Status.ABORTED and len(aborted.output_token_ids) == 2
    assert first.output_token_ids == solo(tiny, SEEDED)
    assert last.output_token_ids == solo(tiny, with_seed(SEEDED, 2))
    assert engine.allocator.num_free_pages == engine.pool.num_pages
    engine.check_integrity()


def test_aborting_the_parent_before_the_fork_starts_no_fork(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE, max_num_batched_tokens=4)  # a prompt of three chunks
    parent = engine.add_request(PROMPT, SEEDED, "a", request_id="p", n=3)
    engine.step()
    assert engine.abort("p") is not None
    assert all(c.status is Status.WAITING and not c.record.pages for c in parent.forks)
    assert set(engine.requests) == set() and not engine.has_unfinished()
    assert engine.allocator.num_free_pages == engine.pool.num_pages


def test_forks_under_preemption_still_sample_their_solo_tokens(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE, num_pages=12)  # 48 tokens: the forks crowd the pool
    parent = engine.add_request(PROMPT, SEEDED, "a", n=3)
    other = engine.add_request(PROMPT[:7], SamplingParams(max_tokens=9, ignore_eos=True), "b")
    run_all(engine, [parent, other, *parent.forks])
    assert sum(r.num_preemptions for r in [other, *parent.forks]) > 0
    for index, child in enumerate(parent.forks):
        assert child.output_token_ids == solo(tiny, with_seed(SEEDED, index))
    assert engine.allocator.num_free_pages == engine.pool.num_pages
    engine.check_integrity()


def test_forks_that_cannot_fit_the_pool_are_refused_before_any_page(tiny: Transformer) -> None:
    engine = make_engine(tiny, page_size=PAGE, num_pages=12)
    with pytest.raises(AdmissionError) as err:
        engine.add_request(PROMPT, SamplingParams(max_tokens=20), "a", request_id="big", n=4)
    assert err.value.code == CONTEXT_LENGTH_EXCEEDED and "n=4" in str(err.value)
    assert engine.events.kinds("big") == ["rejected"]
    assert engine.allocator.num_free_pages == engine.pool.num_pages


def test_forks_count_against_the_tenant_limits_and_max_num_seqs(tiny: Transformer) -> None:
    """n is no way around a tenant's running limit or max_num_seqs: more forks than either allows are
    refused at admission, and a parent is admitted only when all its forks fit beside what runs."""
    engine = make_engine(tiny, page_size=PAGE, max_num_seqs=4, max_running_per_tenant=3)
    with pytest.raises(AdmissionError, match="n=4 exceeds the 3 sequences"):
        engine.add_request(PROMPT, SEEDED, "a", n=4)
    first = engine.add_request(PROMPT, SEEDED, "a", n=2)
    second = engine.add_request(PROMPT, SEEDED, "a", n=2)  # 2 + 2 > 3 for tenant a: waits for the first
    other = engine.add_request(PROMPT, SEEDED, "b", n=3)  # 2 + 3 > max_num_seqs: waits too
    widest = 0
    while not all(r.is_finished for r in [first, second, other, *first.forks, *second.forks, *other.forks]):
        engine.step()
        running = engine.scheduler.running
        widest = max(widest, sum(max(1, len(r.forks)) for r in running))
        assert sum(max(1, len(r.forks)) for r in running if r.tenant == "a") <= 3
    assert widest <= 4
    assert all(c.output_token_ids == solo(tiny, with_seed(SEEDED, c.index)) for c in other.forks)


def refuse(engine: LLMEngine, request_id: str, n: int) -> None:
    with pytest.raises(AdmissionError) as err:
        engine.add_request(PROMPT, SEEDED, "c", request_id=request_id, n=n)
    assert err.value.code == DUPLICATE_REQUEST_ID, request_id


def test_the_ids_of_a_family_stay_its_own_while_any_member_runs(tiny: Transformer) -> None:
    """A parent's forks-to-come hold their ids before they start, and the parent's id stays held while its
    forks run (a decode worker aborts the forks by it); a request with n > 1 claims its forks' ids too.
    Each is refused with 409, and the family's forks still sample their solo tokens."""
    engine = make_engine(tiny, page_size=PAGE, max_num_batched_tokens=4)  # a prompt of three chunks
    parent = engine.add_request(PROMPT, SEEDED, "a", request_id="p", n=2)
    loner = engine.add_request(PROMPT[:3], SEEDED, "b", request_id=fork_id("q", 1))
    engine.step()
    assert parent.status is Status.RUNNING and not loner.is_finished  # nothing forked yet
    refuse(engine, fork_id("p", 1), 1)  # a fork to come
    refuse(engine, "q", 2)  # its fork 1 would take a live id
    run_until_forked(engine, parent)
    refuse(engine, "p", 1)  # the parent's id, its forks running
    assert parent.finish_reason == FORKED and engine.events.kinds("p").count("admitted") == 1
    run_all(engine, [*parent.forks, loner])
    for index, child in enumerate(parent.forks):
        assert child.output_token_ids == solo(tiny, with_seed(SEEDED, index))
    engine.add_request(PROMPT, SEEDED, "c", request_id="p", n=2)  # the family is done: its ids are free
