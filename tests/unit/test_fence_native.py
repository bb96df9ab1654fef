"""The fence's C check (cache/csrc/fence.c) against its numpy reference, on random pools and layouts: the
same rows aborted for the same reasons, the same writes refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvfence.cache.fence import Fence, StepLayout, _native_check
from kvfence.cache.pool import KVPool, PageState
from kvfence.trail.reasons import FOREIGN_OWNER

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
    each kind of violation all occur) and writing random slots."""
    rows = int(rng.integers(1, 7))
    counts = rng.integers(0, 5, rows)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    pages = rng.integers(0, PAGES, int(starts[-1]))
    tenants = rng.integers(0, 3, rows)
    generations = np.where(rng.random(pages.size) < 0.8, pool.generation[pages], pool.generation[pages] + 1)
    num_cached = np.array([rng.integers(0, max(1, c * PAGE_SIZE + 1)) for c in counts], dtype=np.int64)
    writes = int(rng.integers(0, 8))
    write_rows = rng.integers(0, rows, writes)
    write_pages = rng.integers(0, PAGES, writes)
    return StepLayout.of(
        tenants=tenants,
        num_cached=num_cached,
        starts=starts,
        pages=pages,
        generations=generations,
        write_rows=write_rows,
        write_pages=write_pages,
        write_generations=np.where(rng.random(writes) < 0.8, pool.generation[write_pages], 9),
        write_offsets=rng.integers(0, PAGE_SIZE, writes),
        write_positions=np.zeros(writes, dtype=np.int64),
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


@pytest.mark.parametrize("page", [-1, PAGES])
def test_a_page_outside_the_pool_fails_closed(page: int) -> None:
    pool = random_pool(np.random.default_rng(3))
    pool.state[:] = PageState.OWNED
    layout = StepLayout.of(
        tenants=np.array([0]),
        num_cached=np.array([0]),
        starts=np.array([0, 1]),
        pages=np.array([page]),
        generations=np.array([0]),
        write_rows=np.array([0]),
        write_pages=np.array([page]),
        write_generations=np.array([0]),
        write_offsets=np.array([0]),
        write_positions=np.array([0]),
    )
    assert Fence(pool).validate_step(layout) == {0: FOREIGN_OWNER}


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
