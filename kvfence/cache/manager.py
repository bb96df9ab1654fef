"""The scheduler's one door to the KV cache (vLLM's KVCacheManager idea).

`KVCacheManager` stands between the scheduler and the pool, the allocator and the prefix index, so the
scheduler never sees how pages are counted, shared, hashed or published. It speaks in a request's
tokens; every page that changes hands goes on the request's audit trail here, in the order it happened.

The cache sits below `Request` in the house, so it reads a request through the `CachedSequence`
protocol: the attributes it needs, nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvfence.cache.allocator import PageAllocator
from kvfence.cache.block_table import BlockTable
from kvfence.cache.fence import MappingRecord
from kvfence.cache.pool import KVPool, PageState
from kvfence.cache.pool_page import PoolPage
from kvfence.cache.prefix import PrefixCache, extend_chain
from kvfence.trail.events import EventLog
from kvfence.trail.reasons import STALE_WRITE
from kvfence.units import cdiv

if TYPE_CHECKING:  # built by engine/builder.py only where a tier is named
    from kvfence.cache.tiers import KVTiers

RESTORE_BATCH = 16  # pages fetched from the tiers in one call (all at once held 94 MB at 4k tokens: slower)


class CachedSequence(Protocol):
    """What the manager reads and keeps of a request: its record, its tokens and its hash chain."""

    request_id: str
    tenant: str  # whose keys seal its pages in the KV tiers
    record: MappingRecord
    page_hashes: list[int]  # prefix-cache chain over the full pages of all its tokens
    num_published_pages: int  # logical pages already offered to the prefix cache

    @property
    def prefix_namespace(self) -> str:
        """The prefix chain's seed: the tenant's name, and its cache salt where one is set."""

    @property
    def all_token_ids(self) -> list[int]: ...


class KVCacheManager:
    """Pages for a request's tokens: allocate, share a cached prefix, publish full pages, fork, release,
    quarantine. Contract: a sequence's record is edited only through these methods (and so only by the
    allocator); `num_published_pages` never exceeds the pages the record holds."""

    def __init__(
        self,
        pool: KVPool,
        allocator: PageAllocator,
        prefix: PrefixCache | None,
        events: EventLog,
        tiers: KVTiers | None = None,
        fenced: bool = True,
    ) -> None:
        self.pool = pool
        self.fenced = fenced  # restored pages are fenced writes (False: the lab's unfenced writes)
        self.allocator = allocator
        self.prefix = prefix
        self.events = events
        self.tiers = tiers  # sealed KV tiers below the pool (tiers.py); None: the cache ends at the pool
        self._page_nbytes = pool.token_bytes * pool.page_size
        self._scratch = bytearray()  # restores open pages here (_restore_scratch)
        # Requests whose restore the fence refused, by id, with the integrity reason: the engine aborts them
        # before they run (`take_refused_restores`).
        self._refused_restores: dict[str, str] = {}
        self.page_size = pool.page_size
        self.block_table = BlockTable()  # every record's entries: the rows a step gathers its pages from

    def new_record(self, tenant: str) -> MappingRecord:
        """An empty record for a tenant (the pool's owner id comes from the name, never from a request)."""
        return MappingRecord(self.allocator.tenant_id(tenant), table=self.block_table)

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    def pages_needed(self, seq: CachedSequence, num_tokens: int) -> int:
        """Pages to add so that the record covers the sequence's first `num_tokens` tokens."""
        return max(0, cdiv(num_tokens, self.page_size) - len(seq.record))

    def allocate(self, seq: CachedSequence, num_tokens: int) -> bool:
        """Fresh pages (each at a new generation) until the record covers `num_tokens` tokens: all of
        them now, or none and False."""
        count = self.pages_needed(seq, num_tokens)
        if count > self.num_free_pages:
            return False
        if count:
            pages = self.allocator.allocate(seq.record, count)
            generations = list(seq.record.generations[-count:])
            self.events.emit(seq.request_id, "pages_allocated", pages=pages, generations=generations)
        return True

    def share_cached_prefix(self, seq: CachedSequence, num_tokens: int) -> int:
        """Take references on the tenant's cached pages holding the longest prefix of the sequence's first
        `num_tokens` tokens (full pages only), then restore from the KV tiers the full pages that follow
        as far as they hold them; returns how many tokens the record then holds."""
        if self.prefix is None:
            return 0
        extend_chain(seq.prefix_namespace, seq.page_hashes, seq.all_token_ids, self.page_size)
        wanted = num_tokens // self.page_size
        pages = self.prefix.lookup(seq.record.tenant, seq.page_hashes[:wanted])
        if pages:
            self.allocator.share(seq.record, pages)
            self.events.emit(seq.request_id, "prefix_hit", pages=pages, tokens=len(pages) * self.page_size)
        return (len(pages) + self._restore(seq, len(pages), wanted)) * self.page_size

    def _restore(self, seq: CachedSequence, first: int, wanted: int) -> int:
        """Logical pages [first, wanted) from the tiers, in order, while they hold them and pages are free:
        each into a fresh page of the record, as a fenced write of all its slots. Returns how many."""
        if self.tiers is None:
            return 0
        size, restored, started = self.page_size, [], time.perf_counter()
        wanted = min(wanted, first + self.num_free_pages)  # no page is fetched that could not be placed
        logical = first
        while logical < wanted:  # a batch at a time: a few MiB of plaintext held, not the whole prefix
            batch = [(seq.page_hashes[i], i) for i in range(logical, min(logical + RESTORE_BATCH, wanted))]
            scratch = self._restore_scratch(len(batch))
            placed: list[tuple[int, int]] = []  # (page, generation) of each fresh page, in order
            for _ in range(self.tiers.fetch(seq.tenant, batch, size, scratch)):
                if not self.allocate(seq, (logical + len(placed) + 1) * size):
                    break
                placed.append(seq.record.entry(logical + len(placed)))
            if self._write_restored(seq, placed, scratch):
                restored += [page for page, _ in placed]
                logical += len(placed)
            # else: the fresh pages are the record's, unwritten (prefill writes them); the request is aborted
            if logical < batch[-1][1] + 1:  # a miss, or a page that could not be placed: the run ends
                break
        self.tiers.restore_seconds += time.perf_counter() - started
        if restored:
            self.events.emit(seq.request_id, "tier_restored", pages=restored, tokens=len(restored) * size)
        return len(restored)

    def _restore_scratch(self, pages: int) -> memoryview:
        """`pages` pages' worth of the one buffer restores open pages into (the engine thread's alone):
        a fresh buffer per page cost a page fault per 4 KiB of it."""
        wanted = pages * self._page_nbytes
        if len(self._scratch) < wanted:
            self._scratch = bytearray(wanted)
        return memoryview(self._scratch)[:wanted]

    def take_refused_restores(self) -> dict[str, str]:
        """The requests whose tier restore the fence refused since the last call (id -> integrity reason): a
        restore aimed at a page not the request's own is a bookkeeping fault, and the request must not go on
        as if nothing happened."""
        refused, self._refused_restores = self._refused_restores, {}
        return refused

    def _write_restored(
        self, seq: CachedSequence, placed: list[tuple[int, int]], scratch: memoryview
    ) -> bool:
        """Restored pages' bytes (page i at `scratch`'s i-th page-long slice) into the `placed` pages: one
        fenced write of every slot of them all (each page must be the record's tenant's alone at its
        generation, every slot next in order), as any step's write is. False, nothing written,
        `write_refused` on the trail and the request among `take_refused_restores`, when the fence refuses
        any of it."""
        if not placed:
            return True
        targets = [page for page, _ in placed]
        if self.prefix is not None and self.prefix.faults.fire("tier_foreign_write"):
            targets[0] = self._foreign_page(seq, targets[0])
        size = self.page_size
        pages = np.repeat(np.array(targets, dtype=np.int64), size)
        slots = np.tile(np.arange(size, dtype=np.int64), len(targets))
        if self.fenced:
            generations = np.repeat(np.array([g for _, g in placed], dtype=np.int64), size)
            tenants = np.full(pages.size, seq.record.tenant, dtype=np.int64)
            allowed = self.pool.authorize_writes(pages, generations, tenants, slots)
            if not allowed.all():
                refused = int(pages[int(np.argmin(allowed))])
                self.events.emit(seq.request_id, "write_refused", page=refused, why="tier restore")
                self._refused_restores[seq.request_id] = STALE_WRITE
                return False
        for i, page in enumerate(targets):
            self.pool.load_page_bytes(page, scratch[i * self._page_nbytes : (i + 1) * self._page_nbytes])
        self.pool.commit_writes(pages, slots)
        return True

    def _foreign_page(self, seq: CachedSequence, page: int) -> int:
        """Fault `tier_foreign_write`: the restore's target is another request's page (another tenant's where
        there is one), as a restore holding a stale mapping would write. The page returned is written to."""
        owned = np.flatnonzero(self.pool.state == PageState.OWNED)
        mine = set(seq.record.pages)
        others = [int(p) for p in owned if int(p) not in mine]
        foreign = [p for p in others if self.pool.owner[p] != seq.record.tenant] or others
        if not foreign:
            return page
        self.prefix.faults.record("tier_foreign_write", request_id=seq.request_id, page=foreign[0])  # type: ignore[union-attr]
        return foreign[0]

    def publish_full_pages(self, seq: CachedSequence, num_computed: int) -> None:
        """Offer the pages that the sequence's first `num_computed` tokens fill to the prefix cache: their
        content is final. A page whose content another cached page already holds stays private, and a page
        the record no longer holds (a bookkeeping bug freed or reallocated it) is never published: the
        fence aborts the request at its next step, and the cache must not outlive it with that page."""
        if self.prefix is None:
            return
        full = num_computed // self.page_size
        if full <= seq.num_published_pages:
            return
        extend_chain(seq.prefix_namespace, seq.page_hashes, seq.all_token_ids, self.page_size)
        for logical in range(seq.num_published_pages, full):
            page, generation = seq.record.entry(logical)
            if self._holds(seq.record, logical) and not self.prefix.is_cached(page):
                chain = seq.page_hashes[logical]
                tiers = self.tiers
                new_here = tiers is not None and not tiers.holds(seq.tenant, chain)  # not what a tier gave
                if self.prefix.insert(page, chain) and new_here:
                    source = PoolPage(self.pool, page, generation, seq.record.tenant, self.fenced)
                    tiers.offer(seq.tenant, chain, logical, self.page_size, source)
        seq.num_published_pages = full

    def _holds(self, record: MappingRecord, logical: int) -> bool:
        """The record's entry is still its page: same generation, owned by the record's tenant."""
        page, generation = record.entry(logical)
        return self.pool.is_current(page, generation, record.tenant)

    def fork_pages_needed(self, num_tokens: int, count: int) -> int:
        """Fresh pages a fork of `count` sequences after `num_tokens` tokens takes: a copy each of the
        partial last page, none when the tokens end on a page boundary."""
        return count if num_tokens % self.page_size else 0

    def fork(self, parent: CachedSequence, children: Sequence[CachedSequence], num_tokens: int) -> None:
        """Map each child onto the parent's first `num_tokens` tokens: the full pages shared by reference
        (same pages, the parent's generations), the partial last page copied on write into a fresh page
        of the child's own (a new generation, so a child's writes never reach a sibling). The caller has
        checked the parent's record with the fence and made `fork_pages_needed` pages free; the parent
        keeps its own references until it is released."""
        full, slots = divmod(num_tokens, self.page_size)
        source = parent.record.entry(full)[0] if slots else None
        copies = []
        for child in children:
            assert not len(child.record), "a fork starts from an empty record"
            shared = self.allocator.fork(parent.record, child.record, full)
            if source is not None:
                [copy] = self.allocator.allocate(child.record, 1)
                record = child.record
                self.pool.copy_page(source, copy, record.entry(len(record) - 1)[1], record.tenant, slots)
                copies.append(copy)
            child.page_hashes[:] = parent.page_hashes  # the prompt's chain: its full pages are the same
            child.num_published_pages = parent.num_published_pages
            self.events.emit(
                child.request_id,
                "forked",
                tenant=child.tenant,
                parent=parent.request_id,
                pages=list(child.record.pages),
                generations=list(child.record.generations),
                shared=shared,
                copied=copies[-1:],
                source=source,
            )
        self.events.emit(
            parent.request_id,
            "forked",
            children=[c.request_id for c in children],
            shared=list(parent.record.pages[:full]),
            source=source,
            copies=copies,
        )

    def release(self, seq: CachedSequence) -> None:
        """Give back every page of the record (to the prefix cache or the free queue)."""
        seq.num_published_pages = 0
        if len(seq.record):
            pages = list(seq.record.pages)
            self.allocator.release(seq.record)
            self.events.emit(seq.request_id, "released", pages=pages)

    def quarantine(self, seq: CachedSequence) -> None:
        """Block every read and write of the record's pages while a transfer into them may be in flight
        (invariant 4); `release` later, once the transfer is drained."""
        if len(seq.record):
            self.events.emit(seq.request_id, "quarantined", pages=self.allocator.quarantine(seq.record))

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
