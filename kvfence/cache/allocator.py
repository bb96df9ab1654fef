"""Page allocator: the O(1) free queue, reference counts, and a new generation on every allocation.

The allocator is the only code that edits a MappingRecord or a page's generation, owner and state.
Handing a page out always starts a new generation, so any reference kept from an earlier life of the
page stops matching; sharing a cached page (a prefix hit) does not, because its content is unchanged.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvfence.cache.fence import MappingRecord
from kvfence.cache.pool import NO_OWNER, KVPool, PageState
from kvfence.cache.prefix import PrefixCache
from kvfence.trail.faults import FaultInjector


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, pool: KVPool, prefix: PrefixCache | None, faults: FaultInjector) -> None:
        self.pool = pool
        self.prefix = prefix
        self.faults = faults
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(pool.num_pages))
        self._tenant_ids: dict[str, int] = {}
        self.stale_releases = 0  # references a record no longer held when it was released

    @property
    def refcount(self) -> np.ndarray:
        """References per page: the pool's `holders`, which only this allocator edits."""
        return self.pool.holders

    def tenant_id(self, tenant: str) -> int:
        """A stable small integer per tenant name (the pool's `owner` values)."""
        return self._tenant_ids.setdefault(tenant, len(self._tenant_ids))

    def tenant_name(self, tenant_id: int) -> str:
        """The name behind a tenant id ("-" for NO_OWNER)."""
        names = {i: name for name, i in self._tenant_ids.items()}
        return names.get(tenant_id, "-")

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can take now: free ones plus unreferenced cached ones (evicted on demand)."""
        return len(self.free) + (len(self.prefix.evictable) if self.prefix else 0)

    def allocate(self, record: MappingRecord, count: int) -> list[int]:
        """Append `count` fresh pages to `record`, all or nothing."""
        if count > self.num_free_pages:
            raise OutOfPages(f"need {count} pages, {self.num_free_pages} free")
        pages = [self._take_page(record) for _ in range(count)]
        for page in pages:
            if self.prefix is not None:
                self.prefix.forget(page)  # hashes are per generation (a bug may hand out a cached page)
            self.pool.begin_generation(page, record.tenant)
            self.refcount[page] += 1
            record.append(page, int(self.pool.generation[page]))
        return pages

    def _take_page(self, record: MappingRecord) -> int:
        if self.faults.fire("double_allocation"):
            held = np.flatnonzero(self.refcount > 0)
            held = held[~np.isin(held, record.pages)]
            if held.size:  # the bug: a page another request still holds is handed out as if free
                page = int(held[0])
                self.refcount[page] = 0
                self.faults.record("double_allocation", page=page, generation=int(self.pool.generation[page]))
                return page
        if self.free:
            return self.free.popitem(last=False)[0]
        assert self.prefix is not None
        page = self.prefix.evict_lru()
        assert page is not None
        return page

    def share(self, record: MappingRecord, pages: list[int]) -> None:
        """Take a reference on cached pages (a prefix hit) at their current generation."""
        for page in pages:
            if self.refcount[page] == 0 and self.prefix is not None:
                self.prefix.acquire(page)
            self.refcount[page] += 1
            record.append(page, int(self.pool.generation[page]))

    def fork(self, parent: MappingRecord, child: MappingRecord, count: int) -> list[int]:
        """The child takes references on the parent's first `count` entries, at the generations the
        parent's record holds (not the pool's: the fence must judge the child's entries as it would the
        parent's). An entry that is already stale is copied without a reference, as `release` would skip
        it. Returns the pages."""
        pages, generations = parent.pages[:count], parent.generations[:count]
        for page, generation in zip(pages, generations, strict=True):
            if self.pool.generation[page] == generation and self.refcount[page] > 0:
                self.refcount[page] += 1
            child.append(page, generation)
        return list(pages)

    def release(self, record: MappingRecord) -> None:
        """Drop the record's references; pages nobody holds go back to the cache or the free queue.

        Tail pages are released first so that, among a request's cached pages, the deepest are evicted
        first: a shorter prefix is more likely to be shared. An entry whose page has moved on to a new
        generation (or was freed under it) holds no reference any more and is skipped: a stale record can
        never release a page that now belongs to someone else.
        """
        for page, generation in zip(reversed(record.pages), reversed(record.generations), strict=True):
            if self.pool.generation[page] != generation or self.refcount[page] == 0:
                self.stale_releases += 1
                continue
            self._drop_reference(page)
        record.clear()
        if self.faults.fire("stale_mapping"):
            self._free_a_held_page()

    def quarantine(self, record: MappingRecord) -> list[int]:
        """Block every read and write of the record's pages while a transfer into them may still be in
        flight (invariant 4). The references stay: the pages return to the free queue only through
        `release`, once the transfer is confirmed drained."""
        pages = [
            p
            for p, g in zip(record.pages, record.generations, strict=True)
            if self.pool.generation[p] == g and self.refcount[p] > 0
        ]
        self.pool.state[pages] = PageState.QUARANTINED
        return pages

    def _drop_reference(self, page: int) -> None:
        self.refcount[page] -= 1
        if self.refcount[page] > 0:
            return
        if self.prefix is not None and self.prefix.is_cached(page):
            self.prefix.release_unreferenced(page)
        else:
            self.pool.mark_free(page)
            self.free[page] = None

    def _free_a_held_page(self) -> None:
        """Fault: a refcount bug drops every reference to a page another request still maps."""
        held = np.flatnonzero(self.refcount > 0)
        if held.size:
            page = int(held[-1])
            self.refcount[page] = 1
            self._drop_reference(page)
            self.faults.record("stale_mapping", page=page, generation=int(self.pool.generation[page]))
            if page in self.free:
                self.free.move_to_end(page, last=False)  # reused first, as a LIFO free list would

    def check_integrity(self) -> None:
        """Every page is in exactly one place: free queue, evictable cache, or held (refcount > 0)."""
        pool = self.pool
        held = set(np.flatnonzero(self.refcount > 0).tolist())
        evictable = set(self.prefix.evictable) if self.prefix else set()
        free = set(self.free)
        assert not (free & evictable) and not (free & held) and not (evictable & held)
        assert len(free) + len(evictable) + len(held) == pool.num_pages, "a page is lost"
        for page in free:
            assert pool.state[page] == PageState.FREE and pool.owner[page] == NO_OWNER
        for page in evictable:
            assert pool.state[page] == PageState.OWNED and pool.owner[page] != NO_OWNER
        for page in held:
            assert (
                pool.state[page] in (PageState.OWNED, PageState.QUARANTINED) and pool.owner[page] != NO_OWNER
            )
        if self.prefix is not None:
            self.prefix.check_integrity()
            assert all(p not in free for p in self.prefix.hash_by_page), "a free page is still cached"
