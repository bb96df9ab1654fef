"""Tenant-scoped prefix affinity, the decision logic of kvfence's Ray Serve request router
(kvfence.ray.router), free of Ray so that it is tested without a cluster.

Contracts:
- An affinity key is a keyed BLAKE2b MAC (16 bytes) over the tenant and a prefix of the request's text,
  chained chunk by chunk: key 0 covers the tenant alone, key i+1 key i and the text's chunk i (CHUNK_CHARS
  characters), over whole chunks only, at most MAX_CHUNKS. So key i names the tenant and the text's first i
  chunks together; the same text under another tenant gives unrelated keys, and without the MAC key nobody
  (a log, a heap dump of the table) can test a guess of the text. The text itself is never stored. A text
  shorter than one chunk (about one 16-token page of English) has no key: the pool caches whole pages.
- `AffinityTable` maps keys to the replica that last took a request with that prefix, bounded: past
  `capacity` keys the least recently used is forgotten.
- `steer` names the replica holding the request's longest known prefix, unless that replica's queue is
  more than `imbalance_threshold` requests longer than the shortest candidate queue (then no steering, the
  router balances); a replica that is not a candidate (gone, or filtered out) is never named.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence

CHUNK_CHARS = 64  # ~16 tokens of English, one page: a chat's system prompt is a few chunks
MAX_CHUNKS = 256  # 16 KiB of text: past that a prefix's owner is already known
DIGEST_BYTES = 16
MAC_KEY_BYTES = 32
DEFAULT_CAPACITY = 65_536  # keys (~100 bytes each with the table's overhead): a few MB per router
DEFAULT_IMBALANCE_THRESHOLD = 2


def prefix_keys(mac_key: bytes, tenant: str, text: str) -> list[bytes]:
    """The affinity keys of `text` for `tenant`, shortest prefix first: one per chunk (key 0, the tenant
    alone, is not returned: it would steer every request of a tenant to one replica)."""
    if len(mac_key) != MAC_KEY_BYTES:
        raise ValueError(f"the affinity MAC key must be {MAC_KEY_BYTES} bytes, got {len(mac_key)}")
    tenant_bytes = tenant.encode("utf-8", "surrogatepass")
    link = _mac(mac_key, len(tenant_bytes).to_bytes(4, "big") + tenant_bytes)
    keys = []
    whole = min(len(text) // CHUNK_CHARS, MAX_CHUNKS) * CHUNK_CHARS
    for start in range(0, whole, CHUNK_CHARS):
        link = _mac(mac_key, link + text[start : start + CHUNK_CHARS].encode("utf-8", "surrogatepass"))
        keys.append(link)
    return keys


def _mac(mac_key: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, key=mac_key, digest_size=DIGEST_BYTES).digest()


class AffinityTable:
    """Affinity key -> the replica (its id) that took that prefix last; the least recently used goes first."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"the affinity table needs a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._owners: OrderedDict[bytes, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def record(self, keys: Sequence[bytes], replica: str) -> None:
        """`replica` now holds every prefix in `keys` (the longest last, so that it is forgotten last)."""
        for key in keys:
            self._owners[key] = replica
            self._owners.move_to_end(key)
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def owner(self, keys: Sequence[bytes], candidates: Mapping[str, object]) -> str | None:
        """The candidate holding the longest of `keys` (shortest first), or None; a hit counts as a use."""
        for key in reversed(keys):
            replica = self._owners.get(key)
            if replica is not None and replica in candidates:
                self._owners.move_to_end(key)
                return replica
        return None

    def forget(self, replica: str) -> None:
        """Drop every key of a replica that is gone (its pool went with it)."""
        for key in [key for key, owner in self._owners.items() if owner == replica]:
            del self._owners[key]


def steer(
    table: AffinityTable, keys: Sequence[bytes], queue_lens: Mapping[str, int], imbalance_threshold: int
) -> str | None:
    """The replica to send the request to for its prefix, or None to leave it to load balancing.
    `queue_lens` holds every candidate replica's queue length (the candidates are its keys)."""
    if not keys or not queue_lens:
        return None
    owner = table.owner(keys, queue_lens)
    if owner is None:
        return None
    if queue_lens[owner] - min(queue_lens.values()) > imbalance_threshold:
        return None
    return owner
