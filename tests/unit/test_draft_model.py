"""Speculative decoding with a draft model (engine/draft_model.py): greedy output is token for token what
decoding alone gives, whatever the draft model proposes; the draft model's KV lives in a fenced pool of its
own, rolled back where the target rejected its drafts, released when a request leaves; a draft sequence
pointed at another tenant's draft page reads that tenant's KV with the fence off and is aborted with it on."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import make_engine, tiny_model

from kvfence.cache.pool import KVPool
from kvfence.config import SpeculativeConfig
from kvfence.engine.draft_model import DraftModelDrafter
from kvfence.engine.engine import LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import INTEGRITY_REASONS

K = 4
SPEC = SpeculativeConfig("ngram", num_speculative_tokens=K, prompt_lookup_min=1, prompt_lookup_max=1)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32], [40, 41, 42]]
TARGET = tiny_model()


def drafting_engine(
    draft: Transformer, num_pages: int = 64, catch_up: int = 512, **settings: object
) -> tuple[LLMEngine, DraftModelDrafter]:
    """An engine over TARGET whose drafts come from `draft`, its pool of `num_pages` (as build_drafter
    builds one, sized here by the test)."""
    engine = make_engine(TARGET, page_size=4, max_model_len=64, speculative=SPEC, **settings)
    mc = draft.config
    pool = KVPool(mc.num_layers, num_pages, 4, mc.num_kv_heads, mc.head_dim, TARGET.dtype, "cpu")
    drafter = DraftModelDrafter(draft, pool, fenced=engine.config.isolation, catch_up=catch_up)
    engine.scheduler.drafter = drafter
    return engine, drafter


def plain_outputs(prompts: list[list[int]], params: SamplingParams = GREEDY) -> tuple[list, int]:
    engine = make_engine(TARGET, page_size=4, max_model_len=64)
    requests = engine.generate(prompts, params)
    return [r.output_token_ids for r in requests], engine.num_steps


@pytest.mark.parametrize(
    ("draft", "catch_up"),
    [(TARGET, 512), (TARGET, 5), (tiny_model(seed=1), 512)],
    ids=["the target itself", "prompts fed 5 tokens a step", "another model"],
)
def test_greedy_output_is_what_decoding_alone_gives(draft: Transformer, catch_up: int) -> None:
    plain, plain_steps = plain_outputs(PROMPTS)
    engine, drafter = drafting_engine(draft, catch_up=catch_up, max_num_batched_tokens=8)
    requests = engine.generate(PROMPTS, GREEDY)
    assert [r.output_token_ids for r in requests] == plain
    stats = engine.spec_stats
    assert stats.drafts > 0
    if draft is TARGET:  # its own greedy path: every draft is the target's pick
        assert stats.accepted_tokens == stats.draft_tokens
        assert engine.num_steps < plain_steps
    else:
        assert stats.accepted_tokens < stats.draft_tokens
    engine.check_integrity()
    assert drafter.sequences == {}
    assert drafter.allocator.num_free_pages == drafter.pool.num_pages  # every draft page back


def test_rejected_drafts_are_taken_back_from_the_draft_pool() -> None:
    """After each step a draft sequence holds its request's tokens and nothing it drafted past them: the
    slots of the drafts the target rejected are zero, and `written` stops at the tokens kept."""
    engine, drafter = drafting_engine(tiny_model(seed=1))
    request = engine.add_request(PROMPTS[0], GREEDY)
    size, rolled_back = drafter.pool.page_size, 0
    while not request.is_finished:
        engine.step()
        seq = drafter.sequences.get(request.request_id)
        if seq is None or not seq.fed:
            continue
        drafter._synced(request)  # what the next step's prepare does first
        fed = len(seq.fed)
        assert seq.fed == request.all_token_ids[:fed] and fed <= request.num_tokens - 1
        page = seq.record.entry((fed - 1) // size)[0]
        assert drafter.pool.written[page] == (fed - 1) % size + 1
        assert not drafter.pool.kv[:, :, page, (fed - 1) % size + 1 :].any()
        rolled_back += 1
    assert rolled_back > 0 and engine.spec_stats.accepted_tokens < engine.spec_stats.draft_tokens


def test_a_draft_pool_without_room_drafts_nothing_and_changes_nothing() -> None:
    plain, _ = plain_outputs(PROMPTS)
    engine, drafter = drafting_engine(TARGET, num_pages=5)  # one prompt and its drafts fit, not three
    requests = engine.generate(PROMPTS, GREEDY)
    assert [r.output_token_ids for r in requests] == plain
    assert engine.spec_stats.drafts > 0
    assert drafter.allocator.num_free_pages == drafter.pool.num_pages


def _point_at_other_draft_page(drafter: DraftModelDrafter, victim: Request, owner: Request) -> bool:
    """The victim's first draft entry names the owner's first page at the generation before the owner's,
    as a stale mapping would (the victim held that page once, then lost it, its record not told): False
    until both hold pages. Releasing the victim skips it (not its generation), so the owner keeps its page."""
    mine, theirs = drafter.sequences.get(victim.request_id), drafter.sequences.get(owner.request_id)
    if mine is None or theirs is None or not len(mine.record) or not len(theirs.record):
        return False
    page, generation = theirs.record.entry(0)
    drafter.table.pages[mine.record.row, 0] = page
    drafter.table.generations[mine.record.row, 0] = generation - 1
    return True


@pytest.mark.parametrize("isolation", [False, True], ids=["fence off: leak", "fence on: abort"])
def test_a_draft_sequence_mapped_to_another_tenants_page(isolation: bool) -> None:
    """Tenant a's draft sequence maps tenant b's first draft page (stale). Fence off: a's drafts come from
    b's KV (they differ from a clean run's at the same step; its output is still its own, the target
    verifies every draft). Fence on: the fence refuses the draft forward and a is aborted for integrity;
    b ends with its own tokens."""
    draft = TARGET  # drafts equal the target's picks on a clean run: a foreign read shows as a rejection
    prompts = [PROMPTS[0], [p + 1 for p in PROMPTS[0]]]
    plain, _ = plain_outputs(prompts)
    engine, drafter = drafting_engine(draft, isolation=isolation)
    victim = engine.add_request(prompts[0], GREEDY, tenant="a")
    owner = engine.add_request(prompts[1], GREEDY, tenant="b")
    swapped = False
    while engine.has_unfinished():
        engine.step()
        if not swapped and victim.output_token_ids:
            swapped = _point_at_other_draft_page(drafter, victim, owner)
            page = drafter.sequences[owner.request_id].record.entry(0)[0] if swapped else -1
        elif swapped and not owner.is_finished:  # whatever became of a's sequence, b's page is b's
            assert drafter.pool.owner[page] == drafter.allocator.tenant_id("b")
            assert drafter.allocator.refcount[page] == 1
    assert swapped
    assert owner.status is Status.FINISHED and owner.output_token_ids == plain[1]
    if isolation:
        assert victim.status is Status.ABORTED and victim.finish_reason in INTEGRITY_REASONS
        assert sum(engine.integrity_aborts.values()) == 1
    else:
        assert victim.status is Status.FINISHED and victim.output_token_ids == plain[0]
        stats = engine.spec_stats
        assert stats.accepted_tokens < stats.draft_tokens  # drafts from b's KV: some rejected
    # Every page back but one: a's own first page, which the injected bug took out of its record.
    assert drafter.allocator.num_free_pages == drafter.pool.num_pages - 1


def test_drafts_are_asked_for_once_a_step_for_every_row_together() -> None:
    """The scheduler hands the drafter every decode row of a step in one `prepare` (one batched draft
    forward per draft position), then takes each row's drafts."""
    engine, drafter = drafting_engine(TARGET)
    batches: list[list[str]] = []
    prepare = drafter.prepare
    drafter.prepare = lambda wants: (batches.append([r.request_id for r, _ in wants]), prepare(wants))[1]  # type: ignore[method-assign]
    forwards = []
    forward = drafter._forward
    drafter._forward = lambda rows: (forwards.append(len(rows)), forward(rows))[1]  # type: ignore[method-assign]
    engine.generate(PROMPTS, GREEDY)
    assert max(len(b) for b in batches) == len(PROMPTS)
    assert max(forwards) == len(PROMPTS)
    assert np.mean(forwards) > 1
