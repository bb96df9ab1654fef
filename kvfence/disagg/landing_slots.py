"""Decode's side of a one-sided handoff, one landing slot at a time: the slot's sealed bytes are copied
out first (the landing process may rewrite its area while a page is opened), the slot is cleared, and the
copy is opened under the request's key for exactly (request, logical page, page, generation).

Contract: `take` clears the slot whatever it held and returns the plaintext only where the copy opened
(None otherwise: nothing of it may enter a pool); the plaintext is a view of a buffer reused by the next
`take`, so no page-sized buffer is allocated per page. `torn` says whether the copy last taken differs
from the checksum its prefill sent (damaged in transport rather than sealed under another key).
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvfence.disagg.seal import TAG_BYTES, open_into


class LandingSlots:
    def __init__(self, slot_bytes: int) -> None:
        self._sealed = np.empty(slot_bytes, dtype=np.uint8)
        self._plain = np.empty(max(0, slot_bytes - TAG_BYTES), dtype=np.uint8)
        self._taken = self._sealed[:0]

    def take(
        self,
        area: np.ndarray,
        page: int,
        plain_bytes: int,
        key: bytes,
        request_id: str,
        logical: int,
        generation: int,
    ) -> memoryview | None:
        """Slot `page` of `area` ([slots, slot_bytes] uint8): its first `plain_bytes` opened, or None."""
        sealed, plain = self._sealed[: plain_bytes + TAG_BYTES], self._plain[:plain_bytes]
        np.copyto(sealed, area[page, : plain_bytes + TAG_BYTES])
        area[page] = 0
        self._taken = sealed
        return (
            plain.data if open_into(key, request_id, logical, page, generation, sealed, plain.data) else None
        )

    def torn(self, checksum: int) -> bool:
        return xxhash.xxh3_64_intdigest(self._taken) != checksum
