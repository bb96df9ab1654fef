"""A pool page named by the generation it held when it was offered, copied out later on another thread.

Contract: `PoolPage.copy_into(out)` copies the page's bytes (`KVPool.page_bytes`' layout) into `out` and,
fenced, answers True only when, once the copy is done, the page is still the tenant's at the generation
named (`KVPool.is_current`). Every allocation starts a new generation, and a page offered is full (its
written slots are never rewritten at one generation), so a True copy holds exactly the bytes the page held
when it was offered: a page freed, reallocated or written by anyone in between is answered False, never
passed on as the offerer's. Unfenced (the lab's isolation off) it answers True whatever happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvfence.cache.pool import KVPool


@dataclass(frozen=True)
class PoolPage:
    pool: KVPool
    page: int
    generation: int  # the page's when it was offered (the record's entry)
    tenant: int  # the pool's owner id of the offering request's tenant
    fenced: bool = True

    @property
    def nbytes(self) -> int:
        return self.pool.token_bytes * self.pool.page_size

    def copy_into(self, out: np.ndarray) -> bool:
        """The page's bytes into `out` (uint8, `nbytes` long); whether they are the page offered. The check
        comes after the copy: a reallocation before it or during it has moved the generation on by then
        (the GIL the copy takes back orders the check after the engine thread's allocation)."""
        self.pool.copy_page_into(self.page, out)
        return not self.fenced or self.pool.is_current(self.page, self.generation, self.tenant)
