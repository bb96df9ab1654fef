"""The block table (cache/block_table.py): records' entries as rows of persistent arrays, written only
where a page is added, rows reused once a record is cleared, and a step's pages gathered from them."""

from __future__ import annotations

import numpy as np
import pytest

from kvfence.cache.block_table import BlockTable
from kvfence.cache.fence import MappingRecord


def test_records_share_rows_and_grow_past_the_first_size() -> None:
    """More records than rows and more entries than columns: every record still reads back exactly what
    was appended to it, in order."""
    table = BlockTable(rows=2, width=2)
    records = [MappingRecord(t, table=table) for t in range(5)]
    for step in range(7):
        for t, record in enumerate(records):
            record.append(100 * t + step, step + 1)
    for t, record in enumerate(records):
        assert record.pages == tuple(100 * t + s for s in range(7)) and len(record) == 7
        assert record.generations == tuple(range(1, 8)) and record.entry(3) == (100 * t + 3, 4)
    assert table.rows_in_use == 5 and len({r.row for r in records}) == 5


def test_a_cleared_record_gives_its_row_back_empty() -> None:
    table = BlockTable(rows=1, width=4)
    first = MappingRecord(0, [7, 8], [1, 1], table=table)
    row = first.row
    first.clear()
    assert first.row == -1 and first.pages == () and len(first) == 0 and table.rows_in_use == 0
    second = MappingRecord(1, [9], [2], table=table)
    assert second.row == row and second.pages == (9,)  # the row, not the old entries
    with pytest.raises(IndexError):
        second.entry(1)


def test_a_step_gathers_each_rows_first_pages_in_batch_order() -> None:
    table = BlockTable(rows=4, width=4)
    a = MappingRecord(0, [1, 2, 3], [5, 6, 7], table=table)
    b = MappingRecord(1, [4, 5], [8, 9], table=table)
    pages, generations = table.gather(np.array([b.row, a.row]), np.array([1, 3]))
    assert pages.tolist() == [4, 1, 2, 3] and generations.tolist() == [8, 5, 6, 7]


@pytest.mark.parametrize("count", [3, 1])
def test_a_step_cannot_gather_entries_a_record_does_not_hold(count: int) -> None:
    """Past a row's length (its old entries, or nothing) or from an empty record's row -1 (the table's
    last row: another record's): refused, never read."""
    table = BlockTable(rows=4, width=4)
    holder = MappingRecord(0, [1, 2], [1, 1], table=table)
    empty = MappingRecord(0, table=table)
    rows = np.array([holder.row if count == 3 else empty.row])
    with pytest.raises(ValueError, match="more pages than its record holds"):
        table.gather(rows, np.array([count]))
