"""KV tiers below the pool: full prefix pages kept, sealed, in host memory, on disk or in a shared Redis,
and restored into a fresh page of the request that asks, through the fence.

Contract:
- `offer` never blocks the step and copies nothing: the page, named by its generation (pool_page.py), is
  queued for a writer thread that copies it into a buffer of its own, seals it and puts it in every tier;
  a full queue drops the page (counted in `dropped`). The writer seals a copy only when the page was still
  the offerer's at that generation once the copy was done: a page reallocated in between is dropped
  (counted in `stale`), never stored under the offerer's name (fenced; the lab's isolation off copies
  whatever the page holds by then).
- `fetch` searches the tiers in order (each page's value fetched while the one before it is opened) and
  opens a page into the caller's buffer only when a value opens under the tenant's key for exactly that
  model, layout, prefix and place (tier_seal.py); anything else is a miss, counted by tier and reason. It
  never raises for a store's failure.
- What `fetch` opens enters a pool only as a fenced write (KVCacheManager's restore), never otherwise.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvfence.cache.pool_page import PoolPage
from kvfence.cache.tier_seal import SEAL, TierSeal
from kvfence.cache.tier_stores import TierStore, Value

QUEUE_PAGES = 1024  # pages waiting for the writer; beyond, an offer is dropped (the step never waits)
REMEMBERED = 65536  # names this server stored or restored lately: not sealed and stored again


@dataclass
class TierCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    stores: int = 0
    rejected: Counter[str] = field(default_factory=Counter)  # values that did not open, by reason


class KVTiers:
    def __init__(self, stores: list[TierStore], seal: TierSeal) -> None:
        self.stores, self.seal = stores, seal
        self.counters = {store.spec: TierCounters() for store in stores}
        # Each tier's label in metrics: its kind, numbered where two share one (memory, disk, redis, redis_2)
        kinds = [s.kind for s in stores]
        self.labels = {
            s.spec: s.kind
            if kinds[: i + 1].count(s.kind) == 1
            else f"{s.kind}_{kinds[: i + 1].count(s.kind)}"
            for i, s in enumerate(stores)
        }
        self.dropped = 0
        self.stale = 0  # offered pages reallocated before the writer copied them: not stored
        self.restore_seconds = 0.0  # restores at admission, fetch to fenced write (the cache manager's)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._known_lock = threading.Lock()  # the engine thread (restores) and the writer both add names
        self._queue: queue.Queue[tuple[str, int, int, int, PoolPage]] = queue.Queue(QUEUE_PAGES)
        self._staging = np.empty(0, dtype=np.uint8)  # the writer's copy of the page it seals, reused
        self._writer = threading.Thread(target=self._write, name="kvfence-tier-writer", daemon=True)
        self._writer.start()

    def offer(self, tenant: str, chain_hash: int, index: int, slots: int, page: PoolPage) -> None:
        """Store a full page of `tenant`'s prefix (page `index`, hash `chain_hash`) off the step: the page
        is copied on the writer thread, not here (a profile put the engine thread's copies, each into a
        fresh buffer, at 1.5-1.9% of a batch)."""
        try:
            self._queue.put_nowait((tenant, chain_hash, index, slots, page))
        except queue.Full:
            self.dropped += 1

    def holds(self, tenant: str, chain_hash: int) -> bool:
        """Whether this server stored or restored that page lately: offering it again would copy a page
        that `offer` then drops (a restored prefix's pages are published like any other)."""
        return self._is_known(self.seal.name(tenant, chain_hash))

    def fetch(self, tenant: str, pages: list[tuple[int, int]], slots: int, into: memoryview) -> int:
        """The longest run of `pages` ((chain hash, index in the prefix), in order) that the tiers hold in
        values that open, page i's bytes opened into `into`'s i-th page-long slice: each page from the
        first tier whose value opens; the run ends at the first page none has. Returns the run's length.
        `into` is the caller's, reused from call to call: no buffer is allocated per page."""
        size = len(into) // len(pages)
        names = [self.seal.name(tenant, chain) for chain, _ in pages]
        found = [False] * len(pages)
        for store in self.stores:
            wanted = [i for i, hit in enumerate(found) if not hit]
            if not wanted:
                break
            counters = self.counters[store.spec]
            counters.lookups += len(wanted)
            for i, value in zip(wanted, _prefetched(store, [names[i] for i in wanted]), strict=True):
                chain, index = pages[i]
                out = into[i * size : (i + 1) * size]
                why = None if value is None else self.seal.open_into(tenant, chain, index, slots, value, out)
                if value is not None and why is None:
                    counters.hits += 1
                    found[i] = True
                    self._remember(names[i])
                else:
                    counters.misses += 1
                    if why is not None:
                        counters.rejected[why] += 1
        return found.index(False) if False in found else len(found)

    def flush(self) -> None:
        """Wait until every page offered so far is stored (tests; a shutdown that keeps the tier warm)."""
        self._queue.join()

    def writer_cpu_seconds(self) -> float:
        """CPU seconds the writer thread has used so far (its copies, seals and puts): what it can take from
        the steps on a machine whose cores they keep busy."""
        assert self._writer.ident is not None  # started in __init__
        return time.clock_gettime(time.pthread_getcpuclockid(self._writer.ident))

    def describe(self) -> list[dict[str, Any]]:
        """Each tier as /v1/audit/info names it: its kind and spec, what it holds, and its seal."""
        return [
            {
                "tier": s.kind,
                "spec": s.spec,
                "held_bytes": s.held_bytes(),
                "sealed": SEAL,
                "names": "hmac-sha256",
            }
            for s in self.stores
        ]

    def totals(self) -> dict[str, dict[str, int]]:
        """Counters by metric, each by tier label (rejected: by reason over every tier)."""
        by = {label: self.counters[spec] for spec, label in self.labels.items()}
        stores = {self.labels[s.spec]: s for s in self.stores}
        rejected: Counter[str] = Counter()
        for counters in by.values():
            rejected.update(counters.rejected)
        return {
            "lookups": {t: c.lookups for t, c in by.items()},
            "hits": {t: c.hits for t, c in by.items()},
            "misses": {t: c.misses for t, c in by.items()},
            "stores": {t: c.stores for t, c in by.items()},
            "evictions": {t: stores[t].evictions for t in by},
            "errors": {t: stores[t].errors for t in by},
            "skipped": {t: stores[t].skipped for t in by},
            "bytes": {t: stores[t].held_bytes() for t in by},
            "dropped": {t: self.dropped for t in by},  # offers the full queue turned away: lost to every tier
            "stale": {t: self.stale for t in by},  # offers whose page moved on before the copy: likewise
            "rejected": dict(rejected),
        }

    def _remember(self, name: bytes) -> None:
        with self._known_lock:
            self._known[name] = None
            self._known.move_to_end(name)
            while len(self._known) > REMEMBERED:
                self._known.popitem(last=False)

    def _is_known(self, name: bytes) -> bool:
        with self._known_lock:
            return name in self._known

    def _write(self) -> None:
        """The writer thread's loop, for the process's life (a daemon: a page queued at exit is lost)."""
        while True:
            item = self._queue.get()
            try:
                self._store(*item)
            finally:
                self._queue.task_done()

    def _store(self, tenant: str, chain_hash: int, index: int, slots: int, source: PoolPage) -> None:
        """Copy, check, seal and put one offered page (the writer thread's)."""
        name = self.seal.name(tenant, chain_hash)
        if self._is_known(name):
            return
        if self._staging.size != source.nbytes:
            self._staging = np.empty(source.nbytes, dtype=np.uint8)
        if not source.copy_into(self._staging):
            self.stale += 1  # another request's bytes, or none: never sealed under this tenant's name
            return
        value = self.seal.seal(tenant, chain_hash, index, slots, self._staging)
        for store in self.stores:
            self.counters[store.spec].stores += store.put(name, value)
        self._remember(name)


def _prefetched(store: TierStore, names: list[bytes]) -> Iterator[Value | None]:
    """`store.get` of each name, in order, the next one fetched on a thread of its own while the caller
    opens this one: a network or disk read waits outside the GIL, beside the cipher and the copy."""
    if not names:
        return
    with ThreadPoolExecutor(1, thread_name_prefix="kvfence-tier-fetch") as fetcher:
        pending = fetcher.submit(store.get, names[0])
        for name in names[1:]:
            value = pending.result()
            pending = fetcher.submit(store.get, name)
            yield value
        yield pending.result()
