"""Fenced writes are append-only, gapless and exclusive: a written slot is never rewritten, no slot is
skipped (a skipped slot would count as written while it holds a previous owner's KV), and a page another
request can read is never written, even by a writer that names the right page, generation and tenant."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from conftest import TINY, make_engine

from kvfence.cache import fence as fence_module
from kvfence.cache.fence import Fence, MappingRecord, StepLayout
from kvfence.cache.pool import KVPool, PageState
from kvfence.engine import runner as runner_module
from kvfence.engine.engine import LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import STALE_WRITE

PAGE_SIZE = 4


def pool_with(written: list[int], holders: list[int]) -> KVPool:
    """Pages owned by tenant 0 at generation 1, written and held as given."""
    pool = KVPool(
        TINY.num_layers, len(written), PAGE_SIZE, TINY.num_kv_heads, TINY.head_dim, torch.float32, "cpu"
    )
    for page, (slots, held) in enumerate(zip(written, holders, strict=True)):
        pool.begin_generation(page, owner=0)
        pool.written[page], pool.holders[page] = slots, held
    return pool


def allowed(pool: KVPool, page: int, slots: list[int]) -> list[bool]:
    n = len(slots)
    pages, generations, tenants = np.full(n, page), np.ones(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    return pool.authorize_writes(pages, generations, tenants, np.array(slots)).tolist()


def test_a_write_must_come_after_every_written_slot() -> None:
    pool = pool_with(written=[2], holders=[1])
    assert allowed(pool, 0, [2, 3]) == [True, True]  # appending
    assert allowed(pool, 0, [0, 1]) == [False, False]  # rewriting what was written
    assert pool.refused_writes == 2


def test_a_write_must_start_at_the_next_slot_and_leave_no_gap() -> None:
    """The k-th write into a page is at slot written + k: a skip, a repeat or a run that does not start at
    `written` is refused (each write of it that is out of place)."""
    pool = pool_with(written=[1], holders=[1])
    assert allowed(pool, 0, [2]) == [False]  # slot 1 skipped
    assert allowed(pool, 0, [1, 3]) == [True, False]  # slot 2 skipped
    assert allowed(pool, 0, [1, 1]) == [True, False]  # slot 1 twice
    assert allowed(pool, 0, [2, 3]) == [False, False]  # a run after a gap
    assert allowed(pool, 0, [1, 2, 3]) == [True, True, True]
    assert pool.refused_writes == 5


def test_writes_refused_for_another_reason_do_not_take_a_slot() -> None:
    """A stale-generation write into a page (the `stale_write` fault's) is refused on its own: the page's
    holder, writing after it in the same step, still appends at its next slot."""
    pool = pool_with(written=[2], holders=[1])
    pages, tenants = np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64)
    verdict = pool.authorize_writes(pages, np.array([0, 1]), tenants, np.array([2, 2]))
    assert verdict.tolist() == [False, True]


def with_writes(
    reads: StepLayout, rows: list[int], pages: list[int], offsets: list[int], positions: list[int]
) -> StepLayout:
    """`reads` plus writes (row, page at generation 1, slot offset, token position), one per entry."""
    return StepLayout.of(
        starts=reads.starts,
        tenants=reads.tenants,
        num_cached=reads.num_cached,
        pages=reads.pages,
        generations=reads.generations,
        write_rows=np.array(rows),
        write_pages=np.array(pages),
        write_generations=np.ones(len(rows), dtype=np.int64),
        write_offsets=np.array(offsets),
        write_positions=np.array(positions),
    )


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_the_fence_aborts_a_row_whose_write_skips_a_slot(native: bool) -> None:
    """Row 0 reads its page's one written slot and writes slot 2 (slot 1 skipped): the read check passes
    it (slot 1 is not read), only the write rule catches it. Row 1 appends in place and stays clean."""
    pool = pool_with(written=[1, 1], holders=[1, 1])
    records = [MappingRecord(0, [0], [1]), MappingRecord(0, [1], [1])]
    layout = with_writes(StepLayout.reads_only(records, [1, 1]), [0, 1], [0, 1], [2, 1], [1, 1])
    fence = Fence(pool, native_check=native)
    assert (fence._native is not None) == native
    assert fence.validate_step(layout) == {0: STALE_WRITE}
    assert pool.refused_writes == 1


def test_without_the_fence_a_skipped_slot_counts_as_written() -> None:
    """The leak the rule closes, at the pool: committed unchecked, a write of slot 2 over one written slot
    makes `written` 3, and the read check then clears a read of slot 1, which still holds the page's
    previous owner's KV."""
    pool = pool_with(written=[1], holders=[1])
    assert Fence(pool, enabled=False).validate_step(one_write(slot=2)) == {}
    pool.commit_writes(np.array([0]), np.array([2]))
    reads = StepLayout.reads_only([MappingRecord(0, [0], [1])], [3])
    assert Fence(pool).validate_step(reads) == {}, "the skipped slot now passes as written"
    assert Fence(pool_with(written=[1], holders=[1])).validate_step(one_write(slot=2)) == {0: STALE_WRITE}


def one_write(slot: int) -> StepLayout:
    """Row 0 reads the first slot of page 0 and writes `slot` of it."""
    return with_writes(StepLayout.reads_only([MappingRecord(0, [0], [1])], [1]), [0], [0], [slot], [1])


def test_a_shared_fully_written_page_cannot_be_rewritten() -> None:
    """The page a prefix hit shares: generation, owner and state all match (the old rule let it through),
    yet no slot of it can be written, and a shared partial page cannot even be appended to."""
    pool = pool_with(written=[PAGE_SIZE, 1], holders=[2, 2])
    assert pool.generation[0] == 1 and pool.owner[0] == 0 and pool.state[0] == PageState.OWNED
    assert allowed(pool, 0, [0, 1, 2, 3]) == [False] * 4
    assert allowed(pool, 1, [1]) == [False]


def test_the_fence_aborts_a_chunk_that_rewrites_a_shared_prefix_page() -> None:
    """Two requests map the same full prefix page; one step's chunk writes slots 0-3 of it again: that row
    is aborted with stale_write, the other row (appending to its own page) is clean."""
    pool = pool_with(written=[PAGE_SIZE, PAGE_SIZE, 1], holders=[2, 1, 1])
    records = [MappingRecord(0, [0, 1], [1, 1]), MappingRecord(0, [0, 2], [1, 1])]
    reads = StepLayout.reads_only(records, [0, PAGE_SIZE + 1])
    positions = [0, 1, 2, 3, PAGE_SIZE + 1]
    layout = with_writes(reads, [0, 0, 0, 0, 1], [0, 0, 0, 0, 2], [0, 1, 2, 3, 1], positions)
    assert Fence(pool).validate_step(layout) == {0: STALE_WRITE}


class SkipASlot:
    """A test-local fault, wrapped around the runner's `build_layout`: once, the decode write of request
    `victim` lands one slot past its place, as a writer whose slot mapping is off by one would put it. The
    slot it should have filled keeps the page's previous owner's KV, and this very step's attention reads
    it (the context includes the new token's slot). `emitted`: the victim's tokens when it fired."""

    def __init__(self, build: Callable[..., StepLayout]) -> None:
        self.build = build
        self.victim: str | None = None
        self.emitted: int | None = None

    def __call__(self, requests: list[Request], num_new: list[int], page_size: int) -> StepLayout:
        layout = self.build(requests, num_new, page_size)
        rows = [i for i, r in enumerate(requests) if r.request_id == self.victim]
        if self.emitted is not None or not rows or num_new[rows[0]] != 1:
            return layout
        (write,) = np.flatnonzero(layout.write_rows == rows[0])
        if layout.write_offsets[write] + 1 < page_size:  # the next slot is in the same page
            layout.write_offsets[write] += 1
            self.emitted = len(requests[rows[0]].output_token_ids)
        return layout


SETTINGS = {"num_pages": 16, "max_model_len": 64, "enable_prefix_caching": False}
PROMPTS = {n: [(37 * i + n) % 256 for i in range(n)] for n in (9, 14, 56)}


def run(engine: LLMEngine, jobs: list[tuple[str, int, int]]) -> list[Request]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for _, _, m in jobs]
    requests = [engine.add_request(PROMPTS[n], p, t) for (t, n, _), p in zip(jobs, params, strict=True)]
    while not all(r.is_finished for r in requests):
        engine.step()
    return requests


def solo(model: Transformer, request: Request) -> list[int]:
    """`request`'s tokens alone on a fresh engine."""
    job = (request.tenant, len(request.prompt_token_ids), request.params.max_tokens)
    (alone,) = run(make_engine(model, **SETTINGS), [job])
    return alone.output_token_ids


def skipped_slot_run(
    model: Transformer, monkeypatch: pytest.MonkeyPatch, isolation: bool, native: bool
) -> tuple[LLMEngine, SkipASlot, Request, Request]:
    """Tenant a fills the whole pool and finishes (every page keeps a's KV); then b and c run together and
    b's first decode write skips a slot of a page that held a's KV."""
    if not native:
        monkeypatch.setattr(fence_module, "_native_check", lambda: None)
    engine = make_engine(model, isolation=isolation, **SETTINGS)
    assert (engine.fence._native is not None) == native
    run(engine, [("a", 56, 8)])
    fault = SkipASlot(runner_module.build_layout)
    monkeypatch.setattr(runner_module, "build_layout", fault)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    b, c = (engine.add_request(PROMPTS[n], params, t) for t, n in (("b", 14), ("c", 9)))
    fault.victim = b.request_id
    while not (b.is_finished and c.is_finished):
        engine.step()
    assert fault.emitted is not None, "the fault never fired"
    return engine, fault, b, c


def test_a_skipped_slot_leaks_the_previous_owner_without_the_fence(
    tiny: Transformer, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, _, b, c = skipped_slot_run(tiny, monkeypatch, isolation=False, native=True)
    assert b.status is Status.FINISHED and c.status is Status.FINISHED
    assert b.output_token_ids != solo(tiny, b), "reading a's KV in the skipped slot changed no output"
    assert c.output_token_ids == solo(tiny, c)


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
def test_a_skipped_slot_is_refused_before_the_step_reads_it(
    tiny: Transformer, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    """b is aborted in the step whose write skips the slot, before its attention runs: it emits no token
    after the fault (the old `offset >= written` rule let the write through, b read a's KV in that step
    and sampled from it, and only the next step's rewrite of the slot was refused)."""
    engine, fault, b, c = skipped_slot_run(tiny, monkeypatch, isolation=True, native=native)
    assert b.status is Status.ABORTED and b.finish_reason == STALE_WRITE
    assert b.output_token_ids == solo(tiny, b)[: fault.emitted]
    assert engine.events.kinds(b.request_id)[-2:] == ["aborted", "released"]
    assert engine.integrity_aborts == {STALE_WRITE: 1} and engine.pool.refused_writes == 1
    assert c.status is Status.FINISHED and c.output_token_ids == solo(tiny, c)
