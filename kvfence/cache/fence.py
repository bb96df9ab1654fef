"""The fence: the batched validation run before every model step, over expected-mapping records.

A request's MappingRecord (cache/mapping.py, with StepLayout and the numpy read check) says which pages
it may touch, at which generation, for which tenant. The allocator creates and extends it; nothing else
edits it. Before a step, `validate_step` compares every
record in the batch with the pool's metadata in one pass and names the requests that must be aborted:
one call into csrc/fence.c (a Python extension module, a few microseconds) where a C compiler is found,
else the same check in numpy (gathers and compares over flat arrays, no Python loop over pages; also the
C check's reference in the tests). It is deliberately a separate check, not fused into attention: the
model reads only pages the fence has already cleared.
"""

from __future__ import annotations

import ctypes
import functools
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from kvfence.cache.mapping import MappingRecord, StepLayout, check_reads, first_reason_per_row
from kvfence.cache.pool import KVPool, PageState
from kvfence.model import native
from kvfence.trail.reasons import (
    DRAFT_ROLLBACK_REFUSED,
    FOREIGN_OWNER,
    INCOMPLETE_HANDOFF,
    STALE_GENERATION,
    STALE_WRITE,
    UNWRITTEN_READ,
)


@dataclass
class FenceStats:
    """Validation work done (`seconds` includes draft rollbacks). The aborts it causes are counted where
    requests finish (the engine), together with the handoff and transfer-write aborts that reach the engine
    by other paths."""

    checks: int = 0
    seconds: float = 0.0


class Fence:
    """Validates step layouts against a pool. With `enabled` False nothing is checked (lab/bench only)."""

    def __init__(self, pool: KVPool, enabled: bool = True, native_check: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled
        self.stats = FenceStats()
        self._native = _native_check() if native_check else None
        self._next_slot = np.zeros(pool.num_pages, dtype=np.int64)  # the C check's per-page scratch
        # The pool's metadata arrays (and the scratch) are allocated once and only ever edited in place:
        # their addresses go into csrc/fence.c's `struct pool` once, not as arguments of every check.
        arrays = (pool.generation, pool.owner, pool.state, pool.written, pool.holders, self._next_slot)
        self._pool = _PoolArrays(
            pool.generation.size,
            pool.page_size,
            int(PageState.OWNED),
            *(_pointer(a) for a in arrays),
            *_kv_geometry(pool),
        )
        self._pool_address = ctypes.addressof(self._pool)
        self._reasons = np.zeros(64, dtype=np.int8)  # the C check's verdict per row, grown when needed

    def validate_step(self, layout: StepLayout) -> dict[int, str]:
        """Batch rows that must be aborted, each with its reason; empty when the whole batch is clean."""
        if not self.enabled:
            return {}
        started = time.perf_counter()
        verdict = self._native_verdict(layout) if self._native is not None else self._numpy_verdict(layout)
        self.stats.checks += 1
        self.stats.seconds += time.perf_counter() - started
        return verdict

    def _numpy_verdict(self, layout: StepLayout) -> dict[int, str]:
        verdict = self._check_reads(layout)
        verdict.update(
            {row: reason for row, reason in self._check_writes(layout).items() if row not in verdict}
        )
        return verdict

    def _native_verdict(self, layout: StepLayout) -> dict[int, str]:
        """The same verdict from csrc/fence.c, in one call over the layout's and the pool's arrays."""
        rows = layout.tenants.size
        if rows > self._reasons.size:
            self._reasons = np.zeros(2 * rows, dtype=np.int8)
        assert self._native is not None
        bad, refused = self._native.validate(
            layout.flat, rows, layout.write_rows.size, self._pool_address, self._reasons
        )
        if not bad:  # the common case: nothing more to read (a refused write always makes its row bad)
            return {}
        self.pool.refused_writes += refused
        return {row: _REASONS[code] for row, code in enumerate(self._reasons[:rows].tolist()) if code}

    def check_handoff(self, record: MappingRecord, num_tokens: int) -> str | None:
        """Invariant 6: after a transfer, every page must be current, the tenant's, and written far enough
        to hold `num_tokens` tokens. A "complete" message is never trusted on its own."""
        verdict = self._check_reads(StepLayout.reads_only([record], [num_tokens]))
        if verdict or len(record) * self.pool.page_size < num_tokens:
            return INCOMPLETE_HANDOFF
        return None

    def check_record(self, record: MappingRecord, num_tokens: int) -> str | None:
        """Before a request's pages are read outside a step (a parent's pages shared with its forks and its
        partial page copied; a prefill's pages read to be sent): every entry must still be the request's
        and written for `num_tokens` tokens, else the violation. A copy taken from a page that changed
        hands would carry foreign KV into a fresh generation, or another pool, that no later check could
        tell."""
        if not self.enabled:
            return None
        return self._check_reads(StepLayout.reads_only([record], [num_tokens])).get(0)

    def roll_back(self, record: MappingRecord, keep: int, end: int) -> str | None:
        """Take back a request's unaccepted draft slots, tokens [keep, end) of its record (the step wrote up
        to `end`, the request keeps `keep`): page by page through `KVPool.take_back`, which zeroes them and
        moves `written` back, only for the record's tenant, only its own unshared tail. The violation when a
        page refuses (the rest of the tail is left: the request is aborted), else None. With the fence off
        nothing is taken back: the slots keep the drafts' KV (the lab's leak)."""
        if not self.enabled or keep >= end:
            return None
        started, size, refused = time.perf_counter(), self.pool.page_size, None
        for logical in range((end - 1) // size, keep // size - 1, -1):  # the tail's last page first
            page, generation = record.entry(logical)
            start = max(keep - logical * size, 0)
            stop = min(end - logical * size, size)
            if not self._take_back(page, generation, record.tenant, start, stop):
                refused = DRAFT_ROLLBACK_REFUSED
                break
        self.stats.seconds += time.perf_counter() - started  # the fence's share of a step includes it
        return refused

    def _take_back(self, page: int, generation: int, tenant: int, start: int, end: int) -> bool:
        """`KVPool.take_back`, in csrc/fence.c where it is built and the pool is in host memory."""
        if self._native is None or not self._pool.kv:
            return self.pool.take_back(page, generation, tenant, start, end)
        if self._native.take_back(self._pool_address, page, generation, tenant, start, end):
            return True
        self.pool.refused_writes += 1
        return False

    def _check_reads(self, layout: StepLayout) -> dict[int, str]:
        pool = self.pool
        return check_reads(layout, pool.generation, pool.owner, pool.state, pool.written, pool.page_size)

    def _check_writes(self, layout: StepLayout) -> dict[int, str]:
        if layout.write_pages.size == 0:
            return {}
        allowed = self.pool.authorize_writes(
            layout.write_pages,
            layout.write_generations,
            layout.tenants[layout.write_rows],
            layout.write_offsets,
        )
        return first_reason_per_row(layout.write_rows, ((STALE_WRITE, ~allowed),))


# csrc/fence.c's codes.
_REASONS = {1: STALE_GENERATION, 2: FOREIGN_OWNER, 3: UNWRITTEN_READ, 4: STALE_WRITE}
_INT64 = np.dtype(np.int64)


def _pointer(array: np.ndarray) -> int:
    """The address of a contiguous int64 (or int8) array the C check reads: no copy, so never a stale one."""
    assert array.flags.c_contiguous and array.dtype in (_INT64, np.dtype(np.int8)), array.dtype
    return int(array.ctypes.data)


def _kv_geometry(pool: KVPool) -> tuple[int, int, int, int, int]:
    """csrc/fence.c's view of the KV bytes: (address, blocks, block stride, page stride, slot bytes), the
    address 0 where the pool is not in host memory."""
    kv = pool.kv  # allocated once with the pool, contiguous: K/V blocks of every layer one stride apart
    if kv.device.type != "cpu" or not kv.is_contiguous():
        return 0, 0, 0, 0, 0
    size = kv.element_size()
    strides = (kv.stride(1) * size, kv.stride(2) * size, kv.stride(3) * size)
    return kv.data_ptr(), kv.shape[0] * kv.shape[1], *strides


class _PoolArrays(ctypes.Structure):
    """csrc/fence.c's `struct pool`."""

    _fields_ = [
        ("num_pages", ctypes.c_int64),
        ("page_size", ctypes.c_int64),
        ("owned", ctypes.c_int64),
        *(
            (name, ctypes.c_void_p)
            for name in ("generation", "owner", "state", "written", "holders", "next_slot", "kv")
        ),
        *((name, ctypes.c_int64) for name in ("blocks", "block_stride", "page_stride", "slot_bytes")),
    ]


@functools.cache
def _native_check() -> ModuleType | None:
    """csrc/fence.c's module, or None where it cannot be built (the numpy check runs instead)."""
    return native.load_extension("fence", Path(__file__).parent / "csrc")
