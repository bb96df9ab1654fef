"""The fence's C check (cache/csrc/fence.c) against its numpy reference, on random pools and layouts: the
same rows aborted for the same reasons, the same writes refused; and both failing closed on a page id
outside the pool."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfence.cache.fence import Fence, StepLayout, _native_check
from kvfence.cache.pool import KVPool, PageState
from kvfence.trail.reasons import FOREIGN_OWNER, STALE_WRITE

PAGES, PAGE_SIZE = 24, 4


def random_pool(rng: np.random.Generator) -> KVPool:
    pool = KVPool(1, PAGES, PAGE_SIZE, 1, 2, torch.float32, torch.device("cpu"))
    pool.generation[:] = rng.integers(0, 3, PAGES)
    pool.owner[:] = rng.integers(0, 3, PAGES)
    pool.state[:] = rng.choice(
        [PageState.FREE, PageState.OWNED, PageState.OWNED, PageState.QUARANTINED], PAGES
    )
    pool.written[:] = rng.integers(0, PAGE_SIZE + 1, PAGES)
    pool.holders[:] = rng.integers(0, 3, PAGES)
    return pool


def random_layout(rng: np.random.Generator, pool: KVPool) -> StepLayout:
    """Rows reading random pages (mostly at their current generation and owner, so that clean rows and
    each kind of violation all occur, now and then a page id outside the pool) and writing runs of slots
    (mostly from the page's next slot on, else with a gap or a rewrite; a page now and then in two runs)."""
    rows = int(rng.integers(1, 7))
    counts = rng.integers(0, 5, rows)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pages = rng.integers(0, PAGES, int(starts[-1]))
    tenants = rng.integers(0, 3, rows)
    generations = np.where(rng.random(pages.size) < 0.8, pool.generation[pages], pool.generation[pages] + 1)
    pages[rng.random(pages.size) < 0.03] = rng.choice([-1, PAGES, -(2**40), 2**40])
    num_cached = np.array([rng.integers(0, max(1, c * PAGE_SIZE + 1)) for c in counts], dtype=np.int64)
    runs = rng.integers(1, 4, int(rng.integers(0, 4)))
    write_pages = np.repeat(rng.integers(0, PAGES, runs.size), runs)
    within = np.arange(write_pages.size) - np.repeat(np.cumsum(runs) - runs, runs)
    jitter = np.where(rng.random(write_pages.size) < 0.8, 0, rng.integers(-1, 2, write_pages.size))
    write_offsets = np.maximum(pool.written[write_pages] + within + jitter, 0)
    write_generations = np.where(rng.random(write_pages.size) < 0.8, pool.generation[write_pages], 9)
    write_pages[rng.random(write_pages.size) < 0.03] = rng.choice([-1, PAGES])
    return StepLayout.of(
        tenants=tenants,
        num_cached=num_cached,
        starts=starts,
        pages=pages,
        generations=generations,
        write_rows=np.repeat(rng.integers(0, rows, runs.size), runs),
        write_pages=write_pages,
        write_generations=write_generations,
        write_offsets=write_offsets,
        write_positions=np.zeros(write_pages.size, dtype=np.int64),
    )


def test_the_c_check_gives_the_numpy_verdict_on_random_layouts() -> None:
    assert _native_check() is not None, "CI has a C compiler: a silent fallback would leave it untested"
    rng = np.random.default_rng(17)
    reasons = set()
    for _ in range(2000):
        pool = random_pool(rng)
        layout = random_layout(rng, pool)
        reference = Fence(pool, native_check=False).validate_step(layout)
        refused = pool.refused_writes
        assert Fence(pool).validate_step(layout) == reference
        assert pool.refused_writes == 2 * refused
        reasons |= set(reference.values())
    assert len(reasons) == 4, reasons  # every kind of violation was exercised, and clean rows too


@pytest.mark.parametrize("native", [True, False], ids=["c", "numpy"])
@pytest.mark.parametrize("page", [-1, -PAGES, PAGES, 2**40])
@pytest.mark.parametrize("access", ["read", "write"])
def test_a_page_outside_the_pool_fails_closed(access: str, page: int, native: bool) -> None:
    """Row 0 reads or writes a page id outside the pool (every other entry valid): the row is refused,
    as a foreign page, never judged by the page a negative index wraps to, and nothing raises. Row 1
    (the same pages, in range) is clean."""
    pool = random_pool(np.random.default_rng(3))
    pool.state[:], pool.owner[:], pool.holders[:], pool.written[:] = PageState.OWNED, 0, 1, 0
    read, write = (page, 0) if access == "read" else (0, page)
    layout = StepLayout.of(
        tenants=np.array([0, 0]),
        num_cached=np.array([0, 0]),
        starts=np.array([0, 1, 2]),
        pages=np.array([read, 1]),
        generations=pool.generation[[0, 1]],
        write_rows=np.array([0, 1]),
        write_pages=np.array([write, 1]),
        write_generations=pool.generation[[0, 1]],
        write_offsets=np.array([0, 0]),
        write_positions=np.array([0, 0]),
    )
    fence = Fence(pool, native_check=native)
    assert (fence._native is not None) == native
    reason = FOREIGN_OWNER if access == "read" else STALE_WRITE
    assert fence.validate_step(layout) == {0: reason}
    assert pool.refused_writes == (access == "write")


@pytest.mark.parametrize("section", ["starts", "write_rows"])
def test_a_layout_pointing_outside_itself_is_refused_before_anything_is_read(section: str) -> None:
    """An offset past the layout's pages, or a write of a row the batch has not: the C check would read
    beyond the buffer, so it refuses the layout instead of judging it."""
    rng = np.random.default_rng(5)
    pool = random_pool(rng)
    layout = random_layout(rng, pool)
    while layout.write_rows.size == 0:
        layout = random_layout(rng, pool)
    getattr(layout, section)[-1] += 1_000
    with pytest.raises(ValueError, match="malformed step layout"):
        Fence(pool).validate_step(layout)


def test_the_c_rollback_takes_back_what_the_pool_would_and_refuses_what_it_would() -> None:
    """Random rollbacks (mostly the tenant's own written tail, else another generation, tenant, state,
    a shared page, a range that is not the tail, a page id outside the pool) on two copies of a random
    pool of two layers: the C rollback and `KVPool.take_back` agree on every verdict, every byte of the
    KV (the taken-back slots zeroed in each layer's K and V, nothing else touched), `written` and the
    refused-write count."""
    rng = np.random.default_rng(23)
    verdicts = set()
    for _ in range(300):
        pools = [KVPool(2, PAGES, PAGE_SIZE, 1, 2, torch.float32, torch.device("cpu")) for _ in range(2)]
        state = random_pool(rng)
        kv = torch.from_numpy(rng.standard_normal(pools[0].kv.shape).astype(np.float32))
        for pool in pools:
            for name in ("generation", "owner", "state", "written", "holders"):
                getattr(pool, name)[:] = getattr(state, name)
            pool.kv.copy_(kv)
        page = int(rng.choice([int(rng.integers(0, PAGES)), -1, PAGES]))
        inside = 0 <= page < PAGES
        tail = inside and rng.random() < 0.8
        end = int(state.written[page]) if tail else int(rng.integers(0, PAGE_SIZE + 2))
        start = int(rng.integers(-1, max(end, 1)))
        generation = int(state.generation[page]) if inside and rng.random() < 0.8 else 7
        tenant = int(state.owner[page]) if inside and rng.random() < 0.8 else 9
        fence = Fence(pools[0])
        assert fence._native is not None and fence._pool.kv
        native = fence._take_back(page, generation, tenant, start, end)
        reference = pools[1].take_back(page, generation, tenant, start, end)
        assert native == reference
        assert torch.equal(pools[0].kv, pools[1].kv) and np.array_equal(pools[0].written, pools[1].written)
        assert pools[0].refused_writes == pools[1].refused_writes == (not reference)
        if reference:
            assert (pools[0].kv[:, :, page, start:end] == 0).all() and pools[0].written[page] == start
        verdicts.add(reference)
    assert verdicts == {True, False}
