"""Keys the store cannot read or collide, values sealed to their place: what a KV tier holds of a page.

Contract:
- Per tenant, two keys are derived (HKDF-SHA256) from the operator's master key (`--kv-tier-key-file`):
  one MACs entry names, one seals values. Servers that share a tier share the file, so a tenant's entries
  written on one open on the other; no tenant can derive another's.
- An entry's name is HMAC-SHA256(tenant's MAC key, model sha256 | KV layout | the prefix's chain hash up to
  that page): the store sees neither token ids nor the tenant, and two tenants' names for the same prompt
  differ.
- A value is AES-256-GCM under the tenant's sealing key, a fresh random nonce before it, the associated
  data binding tenant, model, layout, chain hash, page index in the prefix and written slots. `open_into`
  gives the plaintext only when all of them match and nothing was changed; otherwise the reason, and
  the caller treats it as a miss. The cipher is gcm.py's: where its kernel loads, outside the GIL.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvfence.cache.gcm import Buffer, Gcm

MASTER_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
LAYOUT_VERSION = 1  # kvfence's page layout: [layers, 2, slots, kv_heads, head_dim], row-major
SEAL = "aes-256-gcm"  # named in /v1/audit/info

# Why a value is not used (counted by reason): all of them are a miss, never an error.
TOO_SHORT = "too_short"
DOES_NOT_OPEN = "does_not_open"  # tampered, truncated, another tenant's, model's, layout's or place's


@dataclass(frozen=True)
class Layout:
    """What a page's bytes mean: a stored page of another layout must never open as this one."""

    page_size: int
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def encode(self) -> bytes:
        fields = (LAYOUT_VERSION, self.page_size, self.num_layers, self.num_kv_heads, self.head_dim)
        return struct.pack(">5Q", *fields) + self.dtype.encode()


class TierSeal:
    """Names and seals for one model and layout, under one master key."""

    def __init__(self, master_key: bytes, model_sha256: str, layout: Layout) -> None:
        if len(master_key) != MASTER_KEY_BYTES:
            raise ValueError(f"a KV tier key is {MASTER_KEY_BYTES} bytes")
        self._master = master_key
        self._place = bytes.fromhex(model_sha256) + layout.encode()
        self._keys: dict[str, tuple[bytes, Gcm]] = {}

    def _tenant(self, tenant: str) -> tuple[bytes, Gcm]:
        keys = self._keys.get(tenant)
        if keys is None:
            derived = HKDF(hashes.SHA256(), 64, salt=None, info=b"kvfence-kv-tier:" + tenant.encode()).derive(
                self._master
            )
            keys = self._keys[tenant] = (derived[:32], Gcm(derived[32:]))
        return keys

    def name(self, tenant: str, chain_hash: int) -> bytes:
        """The entry's name in the store: a MAC, nothing the store can read back."""
        mac_key, _ = self._tenant(tenant)
        message = self._place + chain_hash.to_bytes(16, "little")
        return hmac.new(mac_key, message, hashlib.sha256).digest()

    def _associated(self, tenant: str, chain_hash: int, index: int, slots: int) -> bytes:
        place = self._place + chain_hash.to_bytes(16, "little") + struct.pack(">QQ", index, slots)
        return place + tenant.encode()

    def seal(self, tenant: str, chain_hash: int, index: int, slots: int, page: Buffer) -> memoryview:
        """The value: nonce, ciphertext, tag, in a fresh buffer, read-only. Not zeroed, not copied into
        bytes after: every byte is written by the cipher, outside the GIL where its kernel loads, fresh
        memory's page faults included (a zeroed bytearray copied into bytes, both with the GIL held, cost
        310 us of CPU per kept 0.4 MB page here; this 247)."""
        _, aead = self._tenant(tenant)
        nonce = os.urandom(NONCE_BYTES)
        value = memoryview(np.empty(NONCE_BYTES + memoryview(page).nbytes + TAG_BYTES, dtype=np.uint8))
        value[:NONCE_BYTES] = nonce
        aead.encrypt_into(
            nonce, page, self._associated(tenant, chain_hash, index, slots), value[NONCE_BYTES:]
        )
        return value.toreadonly()

    def open_into(
        self, tenant: str, chain_hash: int, index: int, slots: int, value: bytes | memoryview, out: memoryview
    ) -> str | None:
        """Open `value` into `out`, exactly the page's length: None when it opened, else why it cannot be
        used (then `out` holds bytes that must not be read). A value of any other length cannot be a seal
        of this page: the layout fixes a page's length."""
        if len(value) < NONCE_BYTES + TAG_BYTES:
            return TOO_SHORT
        if len(value) != NONCE_BYTES + len(out) + TAG_BYTES:
            return DOES_NOT_OPEN
        _, aead = self._tenant(tenant)
        associated = self._associated(tenant, chain_hash, index, slots)
        # a view, not a slice: slicing bytes would copy the page
        nonce = bytes(value[:NONCE_BYTES])
        if not aead.decrypt_into(nonce, memoryview(value)[NONCE_BYTES:], associated, out):
            return DOES_NOT_OPEN
        return None
