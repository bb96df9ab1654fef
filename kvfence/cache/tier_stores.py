"""Where a KV tier keeps sealed pages: host memory, a directory, or a Redis server shared by many servers.

Contract (every `TierStore`): `get(name)` returns the value stored under `name` or None; `put(name, value)`
stores it and says whether it did, evicting least recently used entries to stay within its capacity;
neither raises for the store being slow, full, down or wrong: a failure is a miss (None) or a dropped store,
counted in `errors`. A network store that failed is not asked again for `DOWN_S` (those operations are
counted in `skipped`): a wedged server costs the engine thread one timeout, not one a page. The stores hold
opaque names (MACs) and sealed values (tier_seal.py): they are trusted with nothing.
`make_store(spec)` builds the store `--kv-tier` names.
"""

from __future__ import annotations

import math
import os
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvfence.units import parse_size

REDIS_TIMEOUT_S = 0.5  # a store that does not answer by then is a miss: recompute, never wait on it
# A page is ~0.4 MB: read in 1 MiB chunks, one GET is 2.9 GB/s instead of 2.0 with redis-py's 64 KiB.
REDIS_READ_BYTES = 1 << 20
DOWN_S = 5.0  # after a failure a network store is skipped this long, then asked again
Value = bytes | memoryview  # a sealed value: what a store read back, or the writer's seal (not copied)


class TierStore(ABC):
    """One tier's store. Called from the engine thread (get) and the tier's writer (put)."""

    kind: str

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.evictions = 0
        self.errors = 0
        self.skipped = 0

    @abstractmethod
    def get(self, name: bytes) -> Value | None: ...

    @abstractmethod
    def put(self, name: bytes, value: Value) -> bool: ...

    @abstractmethod
    def held_bytes(self) -> int:
        """What it holds now (for a shared store: what this server knows it put)."""


class MemoryTier(TierStore):
    """Host RAM, least recently used first out."""

    kind = "memory"

    def __init__(self, spec: str, capacity: int) -> None:
        super().__init__(spec)
        self.capacity = capacity
        self._entries: OrderedDict[bytes, Value] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, name: bytes) -> Value | None:
        with self._lock:
            value = self._entries.get(name)
            if value is not None:
                self._entries.move_to_end(name)
            return value

    def put(self, name: bytes, value: Value) -> bool:
        if len(value) > self.capacity:
            return False
        with self._lock:
            old = self._entries.pop(name, None)
            self._bytes -= len(old) if old is not None else 0
            while self._entries and self._bytes + len(value) > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= len(evicted)
                self.evictions += 1
            self._entries[name] = value
            self._bytes += len(value)
        return True

    def held_bytes(self) -> int:
        return self._bytes


class DiskTier(TierStore):
    """A directory of one file per entry (its name the MAC in hex), least recently used first out. A write
    goes to a temporary file that is renamed into place: a crash leaves the old entry or the new one,
    never half of one (a half-written temporary is removed at the next start)."""

    kind = "disk"

    def __init__(self, spec: str, directory: Path, capacity: int) -> None:
        super().__init__(spec)
        self.directory, self.capacity = directory, capacity
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        found = []
        for path in directory.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
            elif path.is_file() and len(path.name) == 64:
                stat = path.stat()
                found.append((stat.st_mtime, path.name, stat.st_size))
        for _, name, size in sorted(found):  # oldest first, as they were last written
            self._sizes[name] = size
        self._bytes = sum(self._sizes.values())

    def get(self, name: bytes) -> bytes | None:
        key = name.hex()
        with self._lock:
            if key not in self._sizes:
                return None
            self._sizes.move_to_end(key)
        try:
            return (self.directory / key).read_bytes()
        except OSError:
            self.errors += 1
            return None

    def put(self, name: bytes, value: Value) -> bool:
        if len(value) > self.capacity:
            return False
        key = name.hex()
        temporary = self.directory / f"{key}.{threading.get_ident()}.tmp"
        try:
            with open(temporary, "wb") as file:
                file.write(value)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.directory / key)
        except OSError:
            self.errors += 1
            temporary.unlink(missing_ok=True)
            return False
        with self._lock:
            self._bytes += len(value) - self._sizes.pop(key, 0)
            self._sizes[key] = len(value)
            while self._bytes > self.capacity and len(self._sizes) > 1:
                old, size = self._sizes.popitem(last=False)
                (self.directory / old).unlink(missing_ok=True)
                self._bytes -= size
                self.evictions += 1
        return True

    def held_bytes(self) -> int:
        return self._bytes


class RedisTier(TierStore):
    """A Redis server, shared by every server and worker that names it. Entries expire by Redis's own
    policy (its maxmemory); a timeout or a refused connection is a miss, and the server is skipped for
    `DOWN_S` after it (`clock` tells when)."""

    kind = "redis"

    def __init__(self, spec: str, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(spec)
        import redis  # only where a Redis tier is named

        self._client = redis.Redis.from_url(
            spec,
            socket_timeout=REDIS_TIMEOUT_S,
            socket_connect_timeout=REDIS_TIMEOUT_S,
            socket_read_size=REDIS_READ_BYTES,
        )
        self._errors = (redis.RedisError, OSError)
        self._clock = clock
        self._down_until = -math.inf  # one float, read and set by the engine thread and the writer
        self._put = 0

    def get(self, name: bytes) -> bytes | None:
        value = self._ask(lambda: self._client.get(name))
        return value if isinstance(value, bytes) else None

    def put(self, name: bytes, value: Value) -> bool:
        if self._ask(lambda: self._client.set(name, value)) is None:
            return False
        self._put += len(value)
        return True

    def held_bytes(self) -> int:
        return self._put

    def _ask(self, call: Callable[[], object]) -> object:
        """`call()`'s answer; None when the server failed now (counted in `errors`, then skipped for
        `DOWN_S`) or is being skipped (counted in `skipped`)."""
        if self._clock() < self._down_until:
            self.skipped += 1
            return None
        try:
            return call()
        except self._errors:
            self.errors += 1
            self._down_until = self._clock() + DOWN_S
            return None


def make_store(spec: str) -> TierStore:
    """`memory:SIZE`, `disk:DIR:SIZE` or `redis://HOST:PORT[/DB]` (ValueError naming what is wrong)."""
    kind, directory, capacity = parse_spec(spec)
    if kind == "memory":
        return MemoryTier(spec, capacity)
    if kind == "disk":
        return DiskTier(spec, Path(directory), capacity)
    return RedisTier(spec)


def parse_spec(spec: str) -> tuple[str, str, int]:
    """(kind, directory, capacity) of a tier spec, checked without touching any store (ValueError)."""
    kind, _, rest = spec.partition(":")
    if kind == "memory":
        return kind, "", _capacity(rest, spec)
    if kind == "disk":
        directory, _, size = rest.rpartition(":")
        if not directory:
            raise ValueError(f"{spec!r}: a disk tier is disk:DIR:SIZE")
        return kind, directory, _capacity(size, spec)
    if kind == "redis" and rest.startswith("//") and len(rest) > 2:
        return kind, "", 0
    raise ValueError(f"{spec!r}: a KV tier is memory:SIZE, disk:DIR:SIZE or redis://HOST:PORT[/DB]")


def _capacity(text: str, spec: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise ValueError(f"{spec!r}: {exc}") from exc
    if size <= 0:
        raise ValueError(f"{spec!r}: the size must be positive")
    return size
