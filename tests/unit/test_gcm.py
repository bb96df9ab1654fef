"""The seals' AES-256-GCM (kvfence/cache/gcm.py): byte for byte cryptography's, refusing what was changed,
and, through the kernel, sealing while another thread runs Python.

The GIL test is an order of events, never a clock: the main thread polls the output buffer of a seal in
flight on another thread, and passes when it reads the ciphertext's first block written while the tag
(written last, as the call returns) is still unwritten. A thread that holds the GIL through its call
never lets the poller run between those two moments, so cryptography's path never shows it.
"""

from __future__ import annotations

import os
import random
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kvfence.cache import gcm
from kvfence.cache.gcm import TAG_BYTES, Gcm
from kvfence.disagg import seal

needs_kernel = pytest.mark.skipif(gcm.backend().startswith("cryptography"), reason=gcm.backend())
SIZES = [0, 1, 15, 16, 17, 255, 256, 511, 512, 513, 4096, 368_640, 368_640 + 13, 737_280 + 16 * 31]


def sealed_by(cipher: Gcm, nonce: bytes, plain: bytes, associated: bytes) -> bytes:
    out = bytearray(len(plain) + TAG_BYTES)
    cipher.encrypt_into(nonce, plain, associated, memoryview(out))
    return bytes(out)


@needs_kernel
@pytest.mark.parametrize("size", SIZES + random.Random(7).sample(range(1, 20_000), 40))
def test_the_kernel_seals_what_cryptography_seals_and_each_opens_the_others(size: int) -> None:
    rng = random.Random(size)
    key, nonce = rng.randbytes(32), rng.randbytes(12)
    plain, associated = rng.randbytes(size), rng.randbytes(rng.choice([0, 1, 16, 40, 97]))
    reference = AESGCM(key).encrypt(nonce, plain, associated)
    assert sealed_by(Gcm(key), nonce, plain, associated) == reference
    out = bytearray(size)
    assert Gcm(key).decrypt_into(nonce, reference, associated, memoryview(out))
    assert bytes(out) == plain
    assert AESGCM(key).decrypt(nonce, sealed_by(Gcm(key), nonce, plain, associated), associated) == plain


@needs_kernel
def test_the_kernel_reads_every_kind_of_buffer_the_seals_pass() -> None:
    """bytes, a read-only view into stored bytes (a tier value after its nonce), a numpy array (a landing
    copy) and a writable view (a send slot): the same seal from each."""
    key, nonce = os.urandom(32), os.urandom(12)
    plain = os.urandom(5000)
    stored = b"prefix" + plain
    slot = np.zeros(len(plain) + TAG_BYTES + 8, np.uint8)
    Gcm(key).encrypt_into(nonce, memoryview(stored)[6:], b"a", slot[: len(plain) + TAG_BYTES].data)
    reference = AESGCM(key).encrypt(nonce, plain, b"a")
    assert bytes(slot[: len(reference)]) == reference
    out = np.zeros(len(plain), np.uint8)
    assert Gcm(key).decrypt_into(nonce, slot[: len(reference)], b"a", out.data)
    assert out.tobytes() == plain


@pytest.mark.parametrize("kernel", [True, False])
def test_anything_changed_does_not_open(kernel: bool) -> None:
    rng = random.Random(3)
    key, nonce, associated = rng.randbytes(32), rng.randbytes(12), b"request|page|generation"
    plain = rng.randbytes(3000)
    sealed = AESGCM(key).encrypt(nonce, plain, associated)
    cipher, out = Gcm(key, kernel=kernel), memoryview(bytearray(len(plain)))
    assert cipher.decrypt_into(nonce, sealed, associated, out)
    for where in (0, 1500, len(plain) - 1, len(plain), len(sealed) - 1):  # ciphertext, then tag
        tampered = bytearray(sealed)
        tampered[where] ^= 0x01
        assert not cipher.decrypt_into(nonce, bytes(tampered), associated, out), where
    assert not cipher.decrypt_into(nonce, sealed, associated + b"x", out)
    assert not cipher.decrypt_into(nonce, sealed, associated[:-1], out)
    assert not cipher.decrypt_into(bytes([nonce[0] ^ 1]) + nonce[1:], sealed, associated, out)
    assert not Gcm(rng.randbytes(32), kernel=kernel).decrypt_into(nonce, sealed, associated, out)
    assert not cipher.decrypt_into(nonce, sealed[: TAG_BYTES - 1], associated, memoryview(bytearray(0)))


@pytest.mark.parametrize("kernel", [True, False])
def test_wrong_lengths_are_refused(kernel: bool) -> None:
    cipher = Gcm(bytes(32), kernel=kernel)
    with pytest.raises(ValueError):
        cipher.encrypt_into(bytes(12), b"abc", b"", memoryview(bytearray(3 + TAG_BYTES + 1)))
    with pytest.raises(ValueError):
        cipher.decrypt_into(bytes(12), bytes(3 + TAG_BYTES), b"", memoryview(bytearray(2)))
    with pytest.raises(ValueError):
        cipher.encrypt_into(bytes(16), b"abc", b"", memoryview(bytearray(3 + TAG_BYTES)))
    with pytest.raises(ValueError):
        Gcm(bytes(16), kernel=kernel)


def seen_mid_call(cipher: Gcm, plain: np.ndarray, attempts: int) -> bool:
    """Whether, in one of `attempts` seals of `plain` on another thread, this thread read the ciphertext
    begun and the tag not yet written: Python ran here while the seal was inside its call."""
    for _ in range(attempts):
        out = np.zeros(plain.nbytes + TAG_BYTES, np.uint8)
        sealer = threading.Thread(target=cipher.encrypt_into, args=(bytes(12), plain, b"", out.data))
        sealer.start()
        seen = False
        while sealer.is_alive() and not seen:
            seen = bool(out[:16].any()) and not out[-TAG_BYTES:].any()
        sealer.join()
        assert out[-TAG_BYTES:].any()  # the seal finished: its tag is written
        if seen:
            return True
    return False


@needs_kernel
def test_a_seal_leaves_the_gil_to_other_threads() -> None:
    plain = np.ones(64 << 20, np.uint8)  # a long call: many of the scheduler's slices on a busy machine
    assert not seen_mid_call(Gcm(bytes(32), kernel=False), plain, attempts=3)  # cryptography holds it
    assert seen_mid_call(Gcm(bytes(32)), plain, attempts=50)


@needs_kernel
def test_a_pd_page_sealed_by_the_kernel_is_the_one_cryptography_sealed() -> None:
    """The transfer's format is unchanged: the same bytes in a send slot whichever cipher sealed them, and
    each opens the other's, for this slot only."""
    key, plain = seal.new_key(), os.urandom(30 * 2 * 16 * 3 * 64 * 2 - 5 * 64)
    slots = {kernel: np.zeros(len(plain) + seal.TAG_BYTES, np.uint8) for kernel in (True, False)}
    for kernel, slot in slots.items():
        seal.seal_into(key, "req-1", 3, 17, 2, plain, slot.data, kernel=kernel)
    assert slots[True].tobytes() == slots[False].tobytes()
    out = np.zeros(len(plain), np.uint8)
    for kernel in (True, False):
        assert seal.open_into(key, "req-1", 3, 17, 2, slots[not kernel], out.data, kernel=kernel)
        assert out.tobytes() == plain
        assert not seal.open_into(key, "req-1", 3, 17, 3, slots[not kernel], out.data, kernel=kernel)
        assert not seal.open_into(key, "req-2", 3, 17, 2, slots[not kernel], out.data, kernel=kernel)


def broken(library: Any, flip: str) -> SimpleNamespace:
    """The kernel with one fault: its seal's last ciphertext byte wrong ("seal"), or its open accepting
    anything ("open"). Plain functions, so that loading it may set their ctypes types as on the real one."""

    def kv_gcm_seal(*args: Any) -> None:
        library.kv_gcm_seal(*args)
        size, out = args[5], args[6]  # the plaintext's length, the output buffer
        if flip == "seal" and size:
            out[size - 1] = out.raw[size - 1] ^ 1

    def kv_gcm_open(*args: Any) -> int:
        return 1 if flip == "open" else library.kv_gcm_open(*args)

    return SimpleNamespace(kv_gcm_seal=kv_gcm_seal, kv_gcm_open=kv_gcm_open)


@needs_kernel
@pytest.mark.parametrize("flip", ["seal", "open"])
def test_a_kernel_that_fails_the_self_test_is_never_used(flip: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real kernel passes the known-answer test; one whose seal differs from cryptography's by a byte,
    or whose open accepts a changed tag, fails it, and then every Gcm seals with cryptography's bytes."""
    real = gcm._kernel()
    assert real is not None and gcm.self_test(real)
    assert not gcm.self_test(broken(real, flip))  # type: ignore[arg-type]
    gcm._kernel.cache_clear()
    monkeypatch.setattr(gcm.native, "load_library", lambda *_, **__: (broken(real, flip), None))
    try:
        assert gcm.backend().startswith("cryptography")
        key, nonce, plain = os.urandom(32), os.urandom(12), os.urandom(1000)
        assert sealed_by(Gcm(key), nonce, plain, b"a") == AESGCM(key).encrypt(nonce, plain, b"a")
    finally:
        gcm._kernel.cache_clear()
