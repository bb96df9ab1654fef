"""AES-256-GCM that seals outside the GIL: the cipher both KV seals (tier values, PD pages) use.

Contract:
- `Gcm(key)` seals and opens exactly as cryptography's `AESGCM` with a 12-byte nonce: the ciphertext, then
  the 16-byte tag; the associated data authenticated, not stored. What either seals opens with the other
  (tests/unit/test_gcm.py checks both ways, random sizes, tampering).
- On a CPU with VAES and VPCLMULQDQ (AVX-512), and a C compiler, the cipher is csrc/gcm.c, called
  through `ctypes.CDLL`, which releases the GIL for the whole call: an engine thread runs while another
  thread seals or opens a page (cryptography 48 holds the GIL through its call). Elsewhere it is
  cryptography's `AESGCM`, the same bytes with the GIL held; `backend()` names which this process uses.
  The kernel is built (or found in the kernel cache) on the first seal, not on import, and trusted only
  after a known-answer self-test against cryptography (`self_test`: seals of sizes across its code paths
  equal, each opens, a changed tag does not); one that fails it is never used: cryptography's path is.
- `decrypt_into` is False when the tag does not verify (a changed ciphertext, tag, nonce, associated data
  or key) or the data is shorter than a tag; `out` may then hold bytes that must not be used. A wrong
  nonce or output length raises ValueError, as cryptography's does.
- The caller must not change a buffer while a call on it runs (the GIL no longer keeps other threads out).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvfence.model import native

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
Buffer = bytes | bytearray | memoryview | np.ndarray  # contiguous bytes
_NEEDS = {"avx512f", "avx512bw", "vaes", "vpclmulqdq", "aes", "pclmulqdq"}
_FLAGS = ("-mavx512f", "-mavx512bw", "-mvaes", "-mvpclmulqdq", "-maes", "-mpclmul")
MAX_BYTES = (1 << 36) - 32  # GCM's limit on one message (2^32 - 2 counter blocks)
_P, _N = ctypes.c_void_p, ctypes.c_size_t


@functools.cache
def _kernel() -> ctypes.CDLL | None:
    if not _NEEDS.issubset(native.cpu_flags()):
        return None
    library, _ = native.load_library("gcm", _FLAGS, csrc=Path(__file__).parent / "csrc")
    if library is None:
        return None
    library.kv_gcm_seal.restype = None
    library.kv_gcm_seal.argtypes = [_P, _P, _P, _N, _P, _N, _P, _P]
    library.kv_gcm_open.restype = ctypes.c_int
    library.kv_gcm_open.argtypes = [_P, _P, _P, _N, _P, _N, _P, _P]
    return library if self_test(library) else None


SELF_TEST_SIZES = (0, 1, 15, 16, 17, 511, 512, 513, 4096 + 7)  # a step is 512 bytes: each side of one


def self_test(library: ctypes.CDLL) -> bool:
    """Whether `library`'s seals are cryptography's, byte for byte, and its opens accept exactly them."""
    rng = np.random.default_rng(0x6C6D)
    return all(_agrees(library, size, rng) for size in SELF_TEST_SIZES)


def _agrees(library: ctypes.CDLL, size: int, rng: np.random.Generator) -> bool:
    key, nonce, associated, plain = (rng.bytes(n) for n in (KEY_BYTES, NONCE_BYTES, size % 41, size))
    expected = AESGCM(key).encrypt(nonce, plain, associated)
    cipher, tag = expected[:size], expected[size:]
    sealed, opened = ctypes.create_string_buffer(size + TAG_BYTES), ctypes.create_string_buffer(size + 1)
    tail = ctypes.addressof(sealed) + size
    library.kv_gcm_seal(key, nonce, associated, len(associated), plain, size, sealed, tail)
    opens = library.kv_gcm_open(key, nonce, associated, len(associated), cipher, size, tag, opened) == 1
    read = opened.raw[:size]
    changed = tag[:-1] + bytes([tag[-1] ^ 1])
    refuses = library.kv_gcm_open(key, nonce, associated, len(associated), cipher, size, changed, opened) == 0
    return sealed.raw == expected and opens and read == plain and refuses


def backend() -> str:
    """The cipher a `Gcm` uses here by default."""
    return "kvfence gcm.c (VAES, GIL released)" if _kernel() is not None else "cryptography (GIL held)"


def _address(buffer: Buffer) -> tuple[int | bytes, object]:
    """What the kernel is given for a buffer (bytes as themselves, others their first byte's address), and
    what keeps the buffer exported until the call returns. Nothing is copied."""
    if isinstance(buffer, bytes):
        return buffer, None
    view = memoryview(buffer)
    if not view.nbytes:  # nothing the kernel reads or writes
        return 0, None
    if not view.readonly:  # the common case (send slots, scratch), and ctypes' quickest way to an address
        holder = ctypes.c_char.from_buffer(view)
        return ctypes.addressof(holder), holder
    array = np.frombuffer(view, np.uint8)  # a read-only view (a slice of a stored value)
    return array.ctypes.data, array


class Gcm:
    """One AES-256 key's seals. `kernel=False` takes cryptography's path even where the kernel loads (the
    tests that compare them)."""

    def __init__(self, key: bytes, kernel: bool = True) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"an AES-256-GCM key is {KEY_BYTES} bytes")
        self._key = bytes(key)
        self._kernel = _kernel() if kernel else None
        self._fallback = AESGCM(self._key) if self._kernel is None else None

    def encrypt_into(self, nonce: bytes, data: Buffer, associated: bytes, out: memoryview) -> None:
        """The ciphertext then the tag written into `out`, exactly `len(data) + TAG_BYTES` bytes."""
        size = _checked(nonce, memoryview(data).nbytes, out.nbytes - TAG_BYTES)
        if self._kernel is None:
            assert self._fallback is not None
            self._fallback.encrypt_into(nonce, data, associated, out)
            return
        (source, held), (target, kept) = _address(data), _address(out)
        assert isinstance(target, int)  # `out` is writable
        self._kernel.kv_gcm_seal(
            self._key, nonce, associated, len(associated), source, size, target, target + size
        )
        del held, kept

    def decrypt_into(self, nonce: bytes, data: Buffer, associated: bytes, out: memoryview) -> bool:
        """Whether `data` (ciphertext then tag) opens under this key, nonce and associated data; its
        plaintext is then in `out`, exactly `len(data) - TAG_BYTES` bytes."""
        size = _checked(nonce, memoryview(data).nbytes - TAG_BYTES, out.nbytes)
        if size < 0:  # as cryptography: too short to hold a tag is a seal that does not open
            return False
        if self._kernel is None:
            assert self._fallback is not None
            try:
                self._fallback.decrypt_into(nonce, data, associated, out)
            except InvalidTag:
                return False
            return True
        (source, held), (target, kept) = _address(data), _address(out)
        tag = data[size:] if isinstance(source, bytes) else source + size
        opened = self._kernel.kv_gcm_open(
            self._key, nonce, associated, len(associated), source, size, tag, target
        )
        del held, kept
        return opened == 1


def _checked(nonce: bytes, data: int, out: int) -> int:
    """The plaintext's length (negative: sealed data shorter than a tag), after the checks cryptography
    makes too."""
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a seal's nonce is {NONCE_BYTES} bytes")
    if data > MAX_BYTES:
        raise ValueError(f"AES-GCM seals at most {MAX_BYTES} bytes at once")
    if data >= 0 and data != out:
        raise ValueError(f"the output buffer must be {data} bytes, not {out}")
    return data
