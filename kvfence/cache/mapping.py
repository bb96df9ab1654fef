"""Expected-mapping records and the read check over them, in numpy alone (no torch).

A request's MappingRecord says which pages it may touch, at which generation, for which tenant; a
StepLayout flattens a batch's records for one step; `check_reads` judges a layout's reads against per-page
metadata arrays (generation, owner, state, written) and names the rows that must be aborted, each with its
first failing reason. cache/fence.py runs it against the engine's KVPool (and csrc/fence.c, its native twin);
the vLLM plugin (plugins/vllm) runs it against the tags it keeps on vLLM's blocks. Kept apart from the pool
(which needs torch) so that a process without kvfence's engine can import it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvfence.cache.block_table import BlockTable
from kvfence.trail.reasons import FOREIGN_OWNER, STALE_GENERATION, UNWRITTEN_READ

NO_OWNER = -1


class PageState(enum.IntEnum):
    FREE = 0
    OWNED = 1
    QUARANTINED = 2


class MappingRecord:
    """Pages in logical order with the generation each had when handed out, for one tenant: a row of a
    BlockTable (the cache manager's, shared by every request's record; a record made alone gets its own).
    Allocator-edited only (`append`, `clear`); read as tuples (`pages`, `generations`), by `entry`, or
    through the table's rows (`row`, -1 while the record holds nothing)."""

    __slots__ = ("row", "table", "tenant")

    def __init__(
        self,
        tenant: int,
        pages: Sequence[int] = (),
        generations: Sequence[int] = (),
        table: BlockTable | None = None,
    ) -> None:
        self.tenant = tenant
        self.table = table if table is not None else BlockTable(rows=1)
        self.row = -1
        for page, generation in zip(pages, generations, strict=True):
            self.append(page, generation)

    def __len__(self) -> int:
        return int(self.table.lengths[self.row]) if self.row >= 0 else 0

    @property
    def pages(self) -> tuple[int, ...]:
        return tuple(self.table.pages[self.row, : len(self)].tolist()) if self.row >= 0 else ()

    @property
    def generations(self) -> tuple[int, ...]:
        return tuple(self.table.generations[self.row, : len(self)].tolist()) if self.row >= 0 else ()

    def entry(self, logical: int) -> tuple[int, int]:
        """(page, generation) of one logical page; IndexError past the record's length."""
        if not 0 <= logical < len(self):
            raise IndexError(logical)
        return int(self.table.pages[self.row, logical]), int(self.table.generations[self.row, logical])

    def append(self, page: int, generation: int) -> None:
        if self.row < 0:
            self.row = self.table.take_row()
        self.table.append(self.row, page, generation)

    def clear(self) -> None:
        if self.row >= 0:
            self.table.give_row(self.row)
            self.row = -1


# StepLayout's arrays in the order csrc/fence.c reads them from `StepLayout.flat`.
_SECTIONS = (
    "starts",
    "tenants",
    "num_cached",
    "write_rows",
    "write_pages",
    "write_generations",
    "write_offsets",
    "pages",
    "generations",
)


@dataclass(frozen=True)  # its arrays are edited in place only: a new array would not be in `flat`
class StepLayout:
    """A batch flattened for one step: what each request reads and where each new token is written.

    Row r of the batch reads its first `num_cached[r]` tokens from `pages[starts[r]:starts[r+1]]` and
    writes new token t (at `write_positions[t]`) into `write_pages[t]`, slot `write_offsets[t]`.
    Every array but `write_positions` is a view into `flat`, one int64 buffer: the fence validates it
    through one address, and the model then reads the very arrays the fence cleared.
    """

    flat: np.ndarray
    starts: np.ndarray  # [batch + 1] offsets into pages
    tenants: np.ndarray  # [batch]
    num_cached: np.ndarray  # [batch] tokens that must already be written before the step
    write_rows: np.ndarray  # [new tokens] batch row of each new token
    write_pages: np.ndarray
    write_generations: np.ndarray
    write_offsets: np.ndarray
    pages: np.ndarray  # [sum of mapped pages]
    generations: np.ndarray
    write_positions: np.ndarray  # token position of each new token in its sequence

    @classmethod
    def empty(cls, rows: int, pages: int, writes: int) -> StepLayout:
        """A layout of these sizes to fill in place (its arrays are views into one new `flat`)."""
        sizes = (rows + 1, rows, rows, writes, writes, writes, writes, pages, pages)
        flat = np.empty(sum(sizes), dtype=np.int64)
        views, begin = [], 0
        for size in sizes:
            views.append(flat[begin : begin + size])
            begin += size
        return cls(flat, *views, write_positions=np.empty(writes, dtype=np.int64))

    @classmethod
    def of(cls, write_positions: np.ndarray, **arrays: np.ndarray) -> StepLayout:
        """A layout holding copies of the given arrays (each of `_SECTIONS`, by name)."""
        assert arrays.keys() == set(_SECTIONS), arrays.keys() ^ set(_SECTIONS)
        layout = cls.empty(len(arrays["tenants"]), len(arrays["pages"]), len(arrays["write_rows"]))
        for name, values in arrays.items():
            getattr(layout, name)[:] = values
        layout.write_positions[:] = write_positions
        return layout

    @classmethod
    def reads_only(cls, records: list[MappingRecord], num_cached: list[int]) -> StepLayout:
        """A layout that reads each record's first `num_cached` tokens from all its pages and writes none."""
        no_writes = np.zeros(0, dtype=np.int64)
        return cls.of(
            tenants=np.array([r.tenant for r in records], dtype=np.int64),
            num_cached=np.array(num_cached, dtype=np.int64),
            starts=np.concatenate([[0], np.cumsum([len(r) for r in records])]).astype(np.int64),
            pages=np.array([p for r in records for p in r.pages], dtype=np.int64),
            generations=np.array([g for r in records for g in r.generations], dtype=np.int64),
            write_rows=no_writes,
            write_pages=no_writes,
            write_generations=no_writes,
            write_offsets=no_writes,
            write_positions=no_writes,
        )


def check_reads(
    layout: StepLayout,
    generation: np.ndarray,
    owner: np.ndarray,
    state: np.ndarray,
    written: np.ndarray | None,
    page_size: int,
) -> dict[int, str]:
    """Rows whose reads fail, as csrc/fence.c judges them: each mapped page must be at the record's
    generation, owned by the row's tenant and, where `written` is given, written far enough for the row's
    `num_cached` tokens (`written` None: the caller keeps no per-page write counts, and that part is not
    judged). A page id outside [0, len(generation)) fails closed as a foreign page (never wrapped by a
    negative index, never an IndexError)."""
    pages = layout.pages
    if pages.size == 0:
        return {}
    counts = np.diff(layout.starts)
    rows = np.repeat(np.arange(counts.size), counts)
    inside = (pages >= 0) & (pages < generation.size)
    safe = np.where(inside, pages, 0)  # gathered at page 0 only to be judged foreign below
    failures = [
        (STALE_GENERATION, inside & (generation[safe] != layout.generations)),
        (FOREIGN_OWNER, ~inside | (owner[safe] != layout.tenants[rows]) | (state[safe] != PageState.OWNED)),
    ]
    if written is not None:
        logical = np.arange(pages.size) - layout.starts[rows]
        required = np.clip(layout.num_cached[rows] - logical * page_size, 0, page_size)
        failures.append((UNWRITTEN_READ, inside & (written[safe] < required)))
    return first_reason_per_row(rows, tuple(failures))


def first_reason_per_row(rows: np.ndarray, failures: tuple[tuple[str, np.ndarray], ...]) -> dict[int, str]:
    verdict: dict[int, str] = {}
    for reason, bad in failures:
        if not bad.any():  # the common case, and several times cheaper than np.unique of nothing
            continue
        for row in np.unique(rows[bad]).tolist():
            verdict.setdefault(row, reason)
    return verdict
