"""Sealed KV pages: what a one-sided write carries is AES-256-GCM, under a key the fabric never sees.

Contract:
- A key is made by decode for one transfer (`new_key`) and sent to the one prefill worker the router
  assigned, on the CURVE channel only (a `seal_key` message): UCX, which authenticates nothing, carries
  only sealed bytes, so a process that reads a landing or send area learns nothing and one that writes
  there can only make a transfer fail.
- The associated data binds a sealed page to (request, logical page, target page, generation): a page
  sealed for one slot cannot be replayed into another request, another position or another generation.
- A key seals each logical page once, so the nonce is the logical index (unique per key, as GCM needs).
- `open_page` answers the plaintext or None; nothing of a page that does not open may enter a pool.
"""

from __future__ import annotations

import os
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
SEAL = "aes-256-gcm"  # named in /v1/audit/info
TAG_BYTES = 16  # what sealing adds to a page


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _nonce(logical: int) -> bytes:
    return struct.pack(">IQ", 0, logical)


def _associated(request_id: str, logical: int, page: int, generation: int) -> bytes:
    return struct.pack(">QQQ", logical, page, generation) + request_id.encode()


def seal_page(key: bytes, request_id: str, logical: int, page: int, generation: int, plain: bytes) -> bytes:
    """`plain` (the page's written slots) encrypted and tagged for that one (request, page) slot."""
    return AESGCM(key).encrypt(_nonce(logical), plain, _associated(request_id, logical, page, generation))


def open_page(
    key: bytes, request_id: str, logical: int, page: int, generation: int, sealed: bytes
) -> bytes | None:
    """The plaintext, or None when the bytes were not sealed with `key` for exactly this slot."""
    try:
        return AESGCM(key).decrypt(
            _nonce(logical), sealed, _associated(request_id, logical, page, generation)
        )
    except InvalidTag:
        return None
