"""A GGUF file's header and tensor data, read in one pass over one memory map.

Contract: `GGUFFile(path)` parses the header: `metadata` (every key; arrays as python lists, or skipped
with `arrays=False`), `tensors` (name, ggml type, shape in numpy order [out_features, in_features], and
where the data starts), `data(tensor)` returns a read-only view of a tensor's bytes and `release(tensor)`
lets its pages leave the resident set. A file that is not GGUF (v2 or later), or whose header or data run
past its end, is refused (ValueError).

Why not gguf-py's `GGUFReader`: it builds a numpy view per string of the tokenizer's arrays, 25 s for
Gemma 3's 262,144-entry vocabulary (here: under a second). This module imports neither torch nor gguf-py,
so the CLI's start-up checks read the header without loading either.
"""

from __future__ import annotations

import mmap
import struct
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
        self._arrays = arrays
        if self._map[:4] != b"GGUF":
            raise ValueError("no GGUF magic")
        version, tensor_count, kv_count = struct.unpack_from("<IQQ", self._map, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is not supported")
        self._at = 24
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            value = self._value(self._u32())
            if value is not None:
                self.metadata[key] = value
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        start = -(-self._at // alignment) * alignment
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

    def _need(self, size: int) -> None:
        if self._at + size > len(self._map):
            raise ValueError("the header is cut short")

    def _unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        (value,) = struct.unpack_from(fmt, self._map, self._at)
        self._at += size
        return value

    def _u32(self) -> int:
        return int(self._unpack("<I"))

    def _string(self) -> str:
        (text,) = self._strings(1)
        return text

    def _strings(self, count: int) -> list[str]:
        """`count` strings one after another, in one loop over locals: a vocabulary's (Gemma 3's 262,144)
        took 1.1 s through a call per string."""
        data, at, size, texts = self._map, self._at, len(self._map), []
        for _ in range(count):
            if at + 8 > size or at + 8 + (length := _LENGTH.unpack_from(data, at)[0]) > size:
                raise ValueError("the header is cut short")
            texts.append(data[at + 8 : at + 8 + length].decode("utf-8", "replace"))
            at += 8 + length
        self._at = at
        return texts

    def _value(self, kind: int) -> Any:
        """The value of GGUF type `kind` here (None for a skipped array)."""
        if kind in _SCALARS:
            return self._unpack(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item, count = self._u32(), int(self._unpack("<Q"))
        if item in _NUMPY:
            size = count * struct.calcsize(_SCALARS[item])
            self._need(size)
            values = np.frombuffer(self._map, _NUMPY[item], count, self._at) if self._arrays else None
            self._at += size
            return None if values is None else values.tolist()
        if item == _STRING:
            strings = self._strings(count)
            return strings if self._arrays else None
        items = [self._value(item) for _ in range(count)]  # arrays of arrays: each has its own length
        return items if self._arrays else None

    def _tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._string()
        dims = self._u32()
        ggml_shape = [int(self._unpack("<Q")) for _ in range(dims)]
        kind, offset = self._u32(), int(self._unpack("<Q"))
        return name, kind, tuple(reversed(ggml_shape)), offset
