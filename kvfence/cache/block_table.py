"""Every mapping record's entries as rows of persistent arrays (vLLM v1's BlockTable).

`BlockTable` holds, for each record that holds pages, one row of `pages` and `generations` (int64,
[rows, width]) and its length. A row is written only where an entry is added (`append`), and handed back
whole when its record is cleared, so a step reads the batch's block tables with one gather
(`gather`) instead of rebuilding them from per-request lists.

Contract: a row belongs to one record at a time (`take_row` / `give_row`); entries past a row's length are
never read; the arrays may be reallocated when they grow, so nobody keeps a view of them across an
`append` (a gather copies).
"""

from __future__ import annotations

import numpy as np


class BlockTable:
    def __init__(self, rows: int = 64, width: int = 16) -> None:
        self.pages = np.zeros((rows, width), dtype=np.int64)
        self.generations = np.zeros((rows, width), dtype=np.int64)
        self.lengths = np.zeros(rows, dtype=np.int64)
        self._free = list(range(rows - 1, -1, -1))  # popped from the end: low rows first

    @property
    def rows_in_use(self) -> int:
        return self.lengths.size - len(self._free)

    def take_row(self) -> int:
        """An empty row for a record that gets its first entry."""
        if not self._free:
            self._resize(2 * self.lengths.size, self.pages.shape[1])
        row = self._free.pop()
        self.lengths[row] = 0
        return row

    def give_row(self, row: int) -> None:
        """The record is cleared: its row is empty and may serve another record."""
        self.lengths[row] = 0
        self._free.append(row)

    def append(self, row: int, page: int, generation: int) -> None:
        length = int(self.lengths[row])
        if length == self.pages.shape[1]:
            self._resize(self.lengths.size, 2 * length)
        self.pages[row, length] = page
        self.generations[row, length] = generation
        self.lengths[row] = length + 1

    def gather(self, rows: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The first `counts[i]` entries of each row `rows[i]`, concatenated in that order: (pages,
        generations). Every count must be within its row's length (checked: a shorter row would hand out
        entries its record does not hold)."""
        if rows.size == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        if (rows < 0).any() or (counts > self.lengths[rows]).any():
            raise ValueError("a step maps more pages than its record holds")
        width = int(counts.max())
        keep = np.arange(width) < counts[:, None]
        return self.pages[rows, :width][keep], self.generations[rows, :width][keep]

    def _resize(self, rows: int, width: int) -> None:
        old_rows, old_width = self.pages.shape
        for name in ("pages", "generations"):
            grown = np.zeros((rows, width), dtype=np.int64)
            grown[:old_rows, :old_width] = getattr(self, name)
            setattr(self, name, grown)
        lengths = np.zeros(rows, dtype=np.int64)
        lengths[:old_rows] = self.lengths
        self.lengths = lengths
        self._free[:0] = range(rows - 1, old_rows - 1, -1)  # the new rows, taken after the old free ones
