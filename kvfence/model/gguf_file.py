"""A GGUF file's header and tensor data, read from one memory map.

Contract: `GGUFFile(path)` parses the header: `metadata` (every key; an array is read from the map as a
fresh python list each time it is looked up, or left out with `arrays=False`), `tensors` (name, ggml
type, shape in numpy order [out_features, in_features], and where the data starts), `data(tensor)`
returns a read-only view of a tensor's bytes and `release(tensor)` lets its pages leave the resident set.
A file that is not GGUF (v2 or later), or whose header or data run past its end, is refused (ValueError).

Why not gguf-py's `GGUFReader`: it builds a numpy view per string of the tokenizer's arrays, 25 s for
Gemma 3's 262,144-entry vocabulary (here: under a second). This module imports neither torch nor gguf-py,
so the CLI's start-up checks read the header without loading either.

Why arrays are read when looked up, not at the parse: a vocabulary is ~100,000 small python strings, and
every long-lived object made while they lived (the header's other values, the tensor list, the model the
loader builds) kept its 1 MiB allocator arena from going back when they were freed: the 1.07B engine held
8 such arenas (8 MiB) for good. Read when the tokenizer asks, they live only while it is built (4 held).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8"}
_NUMPY[12] = "<f8"
_STRING, _ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's byte count, before its bytes
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class TensorInfo:
    name: str
    kind: int  # ggml type id (gguf.GGMLQuantizationType)
    shape: tuple[int, ...]  # numpy order: [out_features, in_features] for a weight
    offset: int  # from the start of the file

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


class GGUFFile:
    """The parsed header of one GGUF file, its tensors' bytes mapped (not read) until asked for."""

    def __init__(self, path: Path, arrays: bool = True) -> None:
        self.path = path
        with path.open("rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._map, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        header = _Reader(self._map, 24)
        values: dict[str, Any] = {}
        array_at: dict[str, int] = {}
        for _ in range(kv_count):
            key = header.string()
            kind = header.u32()
            if kind == _ARRAY:
                array_at[key] = header.at
                header.array(keep=False)  # walked (a cut one is refused here), read when looked up
            else:
                values[key] = header.value(kind)
        self.metadata = Metadata(self._map, values, array_at if arrays else {})
        infos = [header.tensor_info() for _ in range(tensor_count)]
        alignment = int(values.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-header.at // alignment) * alignment
        self.tensors = [TensorInfo(name, kind, shape, start + offset) for name, kind, shape, offset in infos]

    def data(self, tensor: TensorInfo, nbytes: int) -> np.ndarray:
        """The tensor's `nbytes` bytes (uint8, read-only, a view of the map)."""
        if tensor.offset + nbytes > len(self._map):
            raise ValueError(f"tensor {tensor.name} runs past the end of the file")
        return np.frombuffer(self._map, dtype=np.uint8, count=nbytes, offset=tensor.offset)

    def release(self, tensor: TensorInfo, nbytes: int) -> None:
        """Let the map's pages holding the tensor's `nbytes` bytes go from this process's resident set
        (the page cache keeps them: a later read faults them back in). For a reader done with a tensor."""
        if not hasattr(mmap, "MADV_DONTNEED"):  # a platform without madvise keeps them
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        self._map.madvise(mmap.MADV_DONTNEED, start, tensor.offset + nbytes - start)


class Metadata(Mapping[str, Any]):
    """A header's key/value pairs (the scalars' and strings' keys first, then the arrays'): scalars and
    strings as parsed; an array read from the map as a new list at each lookup (`in` reads nothing)."""

    def __init__(self, data: mmap.mmap, values: dict[str, Any], array_at: dict[str, int]) -> None:
        self._map, self._values, self._array_at = data, values, array_at

    def __getitem__(self, key: str) -> Any:
        if key in self._values:
            return self._values[key]
        return _Reader(self._map, self._array_at[key]).array(keep=True)

    def __contains__(self, key: object) -> bool:
        return key in self._values or key in self._array_at

    def __iter__(self) -> Iterator[str]:
        yield from self._values
        yield from self._array_at

    def __len__(self) -> int:
        return len(self._values) + len(self._array_at)


class _Reader:
    """A cursor over the header's bytes: each read checks the map's end first ("the header is cut
    short")."""

    def __init__(self, data: mmap.mmap, at: int) -> None:
        self._map, self.at = data, at

    def _need(self, size: int) -> None:
        if self.at + size > len(self._map):
            raise ValueError("the header is cut short")

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._map, self.at)
        self.at += size
        return value

    def u32(self) -> int:
        return int(self._unpack("<I"))

    def string(self) -> str:
        return self._strings(1, keep=True)[0]

    def _strings(self, count: int, keep: bool) -> list[str]:
        """`count` strings one after another (walked, not decoded, unless `keep`), in one loop over locals:
        a vocabulary's (Gemma 3's 262,144) took 1.1 s through a call per string."""
        data, at, size, texts = self._map, self.at, len(self._map), []
        for _ in range(count):
            if at + 8 > size or at + 8 + (length := _LENGTH.unpack_from(data, at)[0]) > size:
                raise ValueError("the header is cut short")
            if keep:
                texts.append(data[at + 8 : at + 8 + length].decode("utf-8", "replace"))
            at += 8 + length
        self.at = at
        return texts

    def value(self, kind: int) -> Any:
        """The value of GGUF type `kind` here."""
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            return self.array(keep=True)
        raise ValueError(f"unknown GGUF value type {kind}")

    def array(self, keep: bool) -> list[Any] | None:
        """The array here as a list (`keep`), or walked past (None)."""
        item, count = self.u32(), int(self._unpack("<Q"))
        if item in _NUMPY:
            size = count * struct.calcsize(_SCALARS[item])
            self._need(size)
            values = np.frombuffer(self._map, _NUMPY[item], count, self.at).tolist() if keep else None
            self.at += size
            return values
        if item == _STRING:
            texts = self._strings(count, keep)
            return texts if keep else None
        if item != _ARRAY:
            raise ValueError(f"unknown GGUF value type {item}")
        items = [self.array(keep) for _ in range(count)]  # arrays of arrays: each has its own length
        return items if keep else None

    def tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self.string()
        dims = self.u32()
        ggml_shape = [int(self._unpack("<Q")) for _ in range(dims)]
        kind, offset = self.u32(), int(self._unpack("<Q"))
        return name, kind, tuple(reversed(ggml_shape)), offset
