"""Sealed KV pages: what a one-sided write carries is AES-256-GCM, under a key the fabric never sees.

Contract:
- A key is made by decode for one transfer (`new_key`) and sent to the one prefill worker the router
  assigned, on the CURVE channel only (a `seal_key` message): UCX, which authenticates nothing, carries
  only sealed bytes, so a process that reads a landing or send area learns nothing and one that writes
  there can only make a transfer fail.
- The associated data binds a sealed page to (request, logical page, target page, generation): a page
  sealed for one slot cannot be replayed into another request, another position or another generation.
- A key seals each logical page once, so the nonce is the logical index (unique per key, as GCM needs).
- `open_into` says whether a page opens (its plaintext then in a scratch buffer); nothing of a page that
  does not open may enter a pool. Both sides work in buffers they own (no fresh page-sized allocation per
  page: each one cost page faults that took more time than the cipher).
"""

from __future__ import annotations

import os
import struct

from kvfence.cache.gcm import Gcm

KEY_BYTES = 32
SEAL = "aes-256-gcm"  # named in /v1/audit/info
TAG_BYTES = 16  # what sealing adds to a page


def new_key() -> bytes:
    return os.urandom(KEY_BYTES)


def _nonce(logical: int) -> bytes:
    return struct.pack(">IQ", 0, logical)


def _associated(request_id: str, logical: int, page: int, generation: int) -> bytes:
    return struct.pack(">QQQ", logical, page, generation) + request_id.encode()


def seal_into(
    key: bytes,
    request_id: str,
    logical: int,
    page: int,
    generation: int,
    plain: bytes,
    out: memoryview,
    kernel: bool = True,
) -> None:
    """`plain` (the page's written slots) encrypted and tagged for that one (request, page) slot, written
    into `out`, exactly `len(plain) + TAG_BYTES` bytes (a send slot: no sealed copy is allocated).
    `kernel=False`: cryptography's cipher, the same bytes (what bench/kv_transport.py compares)."""
    Gcm(key, kernel).encrypt_into(
        _nonce(logical), plain, _associated(request_id, logical, page, generation), out
    )


def open_into(
    key: bytes,
    request_id: str,
    logical: int,
    page: int,
    generation: int,
    sealed: bytes,
    out: memoryview,
    kernel: bool = True,
) -> bool:
    """Whether `sealed` was sealed with `key` for exactly this slot; its plaintext is then in `out`, exactly
    `len(sealed) - TAG_BYTES` bytes. When it is not, `out` may hold garbage that must not be used."""
    return Gcm(key, kernel).decrypt_into(
        _nonce(logical), sealed, _associated(request_id, logical, page, generation), out
    )
