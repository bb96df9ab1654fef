"""Fenced writes are append-only and exclusive: a written slot is never rewritten, and a page another request
can read is never written, even by a writer that names the right page, generation and tenant."""

from __future__ import annotations

import numpy as np
import torch
from conftest import TINY

from kvfence.cache.fence import Fence, MappingRecord, StepLayout
from kvfence.cache.pool import KVPool, PageState
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
    layout = StepLayout.of(
        starts=reads.starts,
        tenants=reads.tenants,
        num_cached=reads.num_cached,
        pages=reads.pages,
        generations=reads.generations,
        write_rows=np.array([0, 0, 0, 0, 1]),
        write_pages=np.array([0, 0, 0, 0, 2]),
        write_generations=np.ones(5, dtype=np.int64),
        write_offsets=np.array([0, 1, 2, 3, 1]),
        write_positions=np.array([0, 1, 2, 3, PAGE_SIZE + 1]),
    )
    assert Fence(pool).validate_step(layout) == {0: STALE_WRITE}
