"""Prefix cache: a hash chain over full pages, namespaced by tenant, with LRU eviction.

The chain for a prompt starts from a seed derived from the tenant's name, so the same tokens under two
tenants hash differently and one tenant can never look up another's pages (invariant 7: the tenant comes
from the authenticated API key, never from a request field). A page's hash is written once per
generation: it is set when the page becomes full and forgotten when the page is evicted.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import xxhash

from kvfence.cache.pool import KVPool
from kvfence.trail.faults import FaultInjector


def extend_chain(tenant: str, hashes: list[int], token_ids: list[int], page_size: int) -> None:
    """Append to `hashes` one 128-bit hash per full page of `token_ids` not yet hashed. Hash i covers the
    tenant and tokens [0, (i+1) * page_size), so equal hashes mean equal tenant and equal prefix."""
    prev = hashes[-1] if hashes else xxhash.xxh3_128_intdigest(b"kvfence-tenant:" + tenant.encode())
    for start in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        page_tokens = np.asarray(token_ids[start : start + page_size], dtype=np.int64).tobytes()
        prev = xxhash.xxh3_128_intdigest(prev.to_bytes(16, "little") + page_tokens)
        hashes.append(prev)


class PrefixCache:
    """hash -> page for full pages; pages nobody references wait in LRU order to be evicted.

    Contract: a page is in `evictable` exactly when it is cached and its reference count is zero; the
    allocator calls `acquire`/`release_unreferenced` as references come and go.
    """

    def __init__(self, pool: KVPool, faults: FaultInjector) -> None:
        self.pool = pool
        self.faults = faults
        self.page_by_hash: dict[int, int] = {}
        self.hash_by_page: dict[int, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.hits = 0  # pages served from the cache
        self.queries = 0  # pages looked up

    def lookup(self, tenant: int, hashes: list[int]) -> list[int]:
        """Cached pages for the longest prefix of `hashes`; the caller must then take references."""
        self.queries += len(hashes)
        if hashes and self.faults.fire("cross_tenant_prefix_hit"):
            return self._foreign_pages(tenant, len(hashes))
        pages = []
        for h in hashes:
            page = self.page_by_hash.get(h)
            if page is None:
                break
            pages.append(page)
        self.hits += len(pages)
        return pages

    def _foreign_pages(self, tenant: int, count: int) -> list[int]:
        """Fault: a lookup that ignores the namespace and the hash, as a colliding or un-namespaced key
        would, and returns another tenant's cached pages."""
        foreign = [p for p in self.hash_by_page if self.pool.owner[p] != tenant][:count]
        self.hits += len(foreign)
        if foreign:
            self.faults.record("cross_tenant_prefix_hit", tenant=tenant, pages=foreign)
        return foreign

    def insert(self, page: int, page_hash: int) -> bool:
        """Publish a full page. False when another page already holds this content (ours stays private)."""
        assert page not in self.hash_by_page, "a page's hash is written once per generation"
        if page_hash in self.page_by_hash:
            return False
        self.page_by_hash[page_hash] = page
        self.hash_by_page[page] = page_hash
        return True

    def is_cached(self, page: int) -> bool:
        return page in self.hash_by_page

    def acquire(self, page: int) -> None:
        """The page gained its first reference: it may no longer be evicted."""
        self.evictable.pop(page, None)

    def release_unreferenced(self, page: int) -> None:
        """The page lost its last reference: keep its content for later hits, evictable last-in-last-out."""
        assert page in self.hash_by_page
        self.evictable[page] = None

    def forget(self, page: int) -> None:
        """The page begins a new generation: whatever hash it had no longer describes it."""
        page_hash = self.hash_by_page.pop(page, None)
        if page_hash is not None:
            del self.page_by_hash[page_hash]
        self.evictable.pop(page, None)

    def evict_lru(self) -> int | None:
        """Drop the least recently released cached page and return it for reuse."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        del self.page_by_hash[self.hash_by_page.pop(page)]
        return page

    def check_integrity(self) -> None:
        assert len(self.page_by_hash) == len(self.hash_by_page)
        for h, page in self.page_by_hash.items():
            assert self.hash_by_page[page] == h
        for page in self.evictable:
            assert page in self.hash_by_page
