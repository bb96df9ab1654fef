"""Load a GGUF file of any architecture in `archs` into GGUF-named tensors, quantized weights kept as codes.

Contract: `load_gguf` returns each tensor under its GGUF name ("blk.3.attn_q.weight") in torch Linear
layout ([out_features, in_features]), llama's Q/K rows restored to HF's rotate-half RoPE order. A weight
stored in a block format of the form code * scale + offset per group (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) is kept only as its codes (`GGUFModel.quantized`, int8, about 1.3 bytes a weight), never as a
float32 copy, and read from the file only when asked for (`QuantizedWeights`; `stored()` gives the file's own
blocks to a packer that decodes them itself): `QuantizedWeight.dequantize()` gives, bit for bit, the float32
tensor transformers and gguf-py's reference dequantizer produce. Every other tensor (norms, F16/BF16/F32
weights, formats without that form) is dequantized into `GGUFModel.tensors`.
"""

from __future__ import annotations

import functools
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvfence.model.archs import architecture
from kvfence.model.archs.base import Header, ModelConfig
from kvfence.model.ggml_types import BLOCK_GEOMETRY, GGMLType
from kvfence.model.gguf_file import GGUFFile, TensorInfo

_Q = GGMLType
_QK_ROWS = re.compile(r"blk\.\d+\.attn_[qk]\.(weight|bias)")
# Weights gguf-py dequantizes at once: 0.5 MiB of float32, under the 1 MiB from which the server maps each
# buffer on its own (engine/heap.py), so that a chunk's temporaries reuse freed heap instead of
# faulting in fresh pages (chunks of 2 MiB: the 1.07B file's layers took 13.9 s to pack, now ~7).
_CHUNK_WEIGHTS = 1 << 17
_PROGRESS_REPORTS = 6  # lines while the dense tensors are read (an F16 file's every weight)
_F16_ONE, _F16_ZERO = np.float16(1).tobytes(), np.float16(0).tobytes()
# K-quant 6-bit scale bytes that unpack (gguf.quants.Q4_K.get_scale_min) to scale 1 and min 0 everywhere.
_UNIT_K_SCALES = bytes([1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1])


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as the GGUF stores it: w[n, k] = codes[n, k] * scales[n, k // g] + offsets[n, k // g],
    g (`group`) weights sharing a scale: 32, or 16 for Q6_K.

    In float32 that is bit for bit the reference dequantization: each format's scale (for K-quants the
    super-block scale times the 6- or 8-bit sub-block scale) times a code is exact or rounds once, as the
    reference's product does, and the add rounds once, as the reference's add or subtract does."""

    codes: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features, in_features // group] float32
    offsets: torch.Tensor  # [out_features, in_features // group] float32

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight ([out_features, in_features]), or only its `rows` (an embedding lookup)."""
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if rows is not None:
            codes, scales, offsets = codes[rows], scales[rows], offsets[rows]
        n, k = codes.shape
        blocks = codes.float().view(n, k // self.group, self.group)
        return (blocks * scales[..., None] + offsets[..., None]).view(n, k)


@dataclass(frozen=True)
class StoredWeight:
    """A block-format weight as the file stores it, for a packer that reads the blocks itself
    (block_packer.py): `blocks` [out_features * in_features / block size, bytes per block], a view of
    the file's map, row after row; output feature n is stored row `rows[n]` (llama's Q/K rows are
    reordered, as `QuantizedWeight`'s codes are)."""

    kind: GGMLType
    shape: tuple[int, int]  # [out_features, in_features]
    blocks: np.ndarray
    rows: np.ndarray


class QuantizedWeights(Mapping[str, QuantizedWeight]):
    """A file's block-format weights by GGUF name, each read from the memory map when asked for and kept
    by no one here. A model that packs one projection at a time so holds one projection's codes at once:
    the whole file's int8 codes and float32 scales are 2.2x a Q4_0 file's bytes, and with them all read
    first the 0.6 GB 1.07B file peaked at 2.07 GB resident while loading. Once read, a weight's pages of
    the map are let go (the page cache keeps them), so the file is not resident beside its packed copy."""

    def __init__(self, file: GGUFFile, infos: list[TensorInfo], config: ModelConfig, permute: bool) -> None:
        self._file, self._config, self._permute = file, config, permute
        self._infos = {info.name: info for info in infos}

    def __getitem__(self, name: str) -> QuantizedWeight:
        info = self._infos[name]
        raw = _raw(self._file, info)
        blocks = read_blocks(_kind(info), info.shape, raw)
        assert blocks is not None  # only block formats are listed here
        self._file.release(info, raw.nbytes)
        fix = functools.partial(_unpermute_rope_rows, name, self._config) if self._permute else None
        return QuantizedWeight(*(torch.from_numpy(fix(part) if fix else part) for part in blocks))

    @contextmanager
    def stored(self, names: Sequence[str]) -> Iterator[list[StoredWeight]]:
        """The weights `names` as the file stores them; their pages of the map are let go on exit."""
        infos = [self._infos[name] for name in names]
        raws = [_raw(self._file, info) for info in infos]
        try:
            yield [self._stored(info, raw) for info, raw in zip(infos, raws, strict=True)]
        finally:
            for info, raw in zip(infos, raws, strict=True):
                self._file.release(info, raw.nbytes)

    def _stored(self, info: TensorInfo, raw: np.ndarray) -> StoredWeight:
        out_features, in_features = info.shape
        rows = np.arange(out_features)[:, None]
        if self._permute:
            rows = _unpermute_rope_rows(info.name, self._config, rows)
        return StoredWeight(_kind(info), (out_features, in_features), raw, rows[:, 0])

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos  # Mapping's own would read and decode the weight to answer

    def __len__(self) -> int:
        return len(self._infos)


@dataclass
class GGUFModel:
    """A loaded GGUF: config, float tensors, quantized weights (CPU codes, read as asked for), the key/value
    metadata as python values, and how many tensors each storage type holds (`quantization`, llama.cpp's
    load log)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: Mapping[str, object]
    path: Path
    quantized: Mapping[str, QuantizedWeight] = field(default_factory=dict)
    quantization: dict[str, int] = field(default_factory=dict)


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> GGUFModel:
    """Read a GGUF: quantized weights as codes (each read when asked for), every other tensor dequantized to
    `dtype` on `device`.

    Raises ValueError for an architecture `archs` does not know, a tensor its forward would not read
    (e.g. MoE experts), rather than silently dropping weights the model would need, or a tensor whose
    bytes do not fit its type or the file."""
    path = Path(path)
    report = progress or (lambda _message: None)
    start = time.perf_counter()
    file = GGUFFile(path)
    config, metadata = _header(file)
    report(f"{path.name}: header read, {len(file.tensors)} tensors, {config.num_layers} layers")
    permute = architecture(config.architecture).permute_qk
    tensors: dict[str, torch.Tensor] = {}
    blocks: list[TensorInfo] = []
    dense: list[TensorInfo] = []
    for info in file.tensors:
        (blocks if _is_blocks(_kind(info), info.shape) else dense).append(info)
    for info in blocks:
        _raw(file, info)  # bytes that do not fit the type or the file fail the load, not the model's ask
    report_every = max(1, len(dense) // _PROGRESS_REPORTS)
    for done, info in enumerate(dense, start=1):
        weights = _dequantize(file, info)
        weights = _unpermute_rope_rows(info.name, config, weights) if permute else weights
        tensors[info.name] = torch.from_numpy(weights).to(dtype=dtype, device=device)
        if done % report_every == 0 or done == len(dense):
            report(f"{path.name}: {done}/{len(dense)} dense tensors ({time.perf_counter() - start:.1f}s)")
    kinds = Counter(_kind(info).name for info in file.tensors)
    quantized = QuantizedWeights(file, blocks, config, permute)
    return GGUFModel(config, tensors, metadata, path, quantized, dict(sorted(kinds.items())))


def read_header(path: str | Path) -> tuple[ModelConfig, Mapping[str, object]]:
    """Config and metadata without reading any tensor data (enough for a tokenizer: the router)."""
    return _header(GGUFFile(Path(path)))


def _header(file: GGUFFile) -> tuple[ModelConfig, Mapping[str, object]]:
    """The config, checked against the file's tensors, and every key/value pair of the file."""
    shapes = {info.name: info.shape for info in file.tensors}
    arch = architecture(file.metadata.get("general.architecture"))
    config = arch.config(Header(file.metadata, shapes))
    arch.check_tensors(set(shapes), config.num_layers)
    return config, file.metadata


def _kind(info: TensorInfo) -> _Q:
    try:
        return _Q(info.kind)
    except ValueError:
        raise ValueError(f"tensor {info.name}: unknown ggml type {info.kind}") from None


def _raw(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """The tensor's bytes as ggml stores them: [blocks, bytes per block] (a plain float type's block is one
    element)."""
    kind = _kind(info)
    block_size, block_bytes = BLOCK_GEOMETRY[kind]
    if info.shape[-1] % block_size:
        raise ValueError(f"tensor {info.name}: rows of {info.shape[-1]} are not whole {kind.name} blocks")
    return file.data(info, info.elements // block_size * block_bytes).reshape(-1, block_bytes)


def _dequantize(file: GGUFFile, info: TensorInfo) -> np.ndarray:
    """Float32 in numpy order ([out_features, in_features]), in memory torch may own."""
    weights = _dequantize_blocks(_raw(file, info), _Q(info.kind)).reshape(info.shape)
    return weights if weights.flags.writeable and weights.flags.owndata else weights.copy()


def _dequantize_blocks(blocks: np.ndarray, kind: _Q, dtype: type = np.float32) -> np.ndarray:
    """[blocks, bytes] -> [blocks * block_size] of `dtype`. Plain floats are read here; any other type by
    gguf-py's reference dequantizer (loaded on first use), in chunks of `_CHUNK_WEIGHTS` passed as one row
    each: given the blocks as rows, gguf-py works through them 16 at a time (22 s for Gemma 3 270M's
    weights; in chunks, under 2), and a chunk at a time no whole tensor is ever float32 on its way to int8
    codes."""
    if kind in _FLOATS:
        return blocks.reshape(-1).view(_FLOATS[kind]).astype(dtype)
    if kind == _Q.BF16:  # the high half of a float32
        return (blocks.reshape(-1).view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(dtype)
    import gguf  # 2.7 MiB resident: loaded by the first load that needs it (ggml_types.py)

    step = max(1, _CHUNK_WEIGHTS // BLOCK_GEOMETRY[kind][0])
    chunks = (blocks[i : i + step].reshape(1, -1) for i in range(0, len(blocks), step))
    reference = gguf.GGMLQuantizationType(int(kind))
    out = [gguf.quants.dequantize(chunk, reference).reshape(-1).astype(dtype) for chunk in chunks]
    return np.concatenate(out) if len(out) != 1 else out[0]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The float16 stored at byte `at` of each block, as float32 [blocks, 1]."""
    return blocks[:, at : at + 2].copy().view(np.float16).astype(np.float32)


def _scales_of(kind: _Q, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, bytes]]:
    """(scales, offsets) [blocks, groups per block] of one format, and the byte patches that turn its
    blocks into "unit" blocks (every scale 1, every offset 0), which dequantize to the codes themselves."""
    if kind in (_Q.Q4_0, _Q.Q5_0, _Q.Q8_0):
        return _f16(blocks, 0), np.zeros((len(blocks), 1), np.float32), {0: _F16_ONE}
    if kind in (_Q.Q4_1, _Q.Q5_1):
        return _f16(blocks, 0), _f16(blocks, 2), {0: _F16_ONE, 2: _F16_ZERO}
    if kind in (_Q.Q4_K, _Q.Q5_K):  # d, dmin, then 8 packed 6-bit (scale, min) pairs: w = d*sc*q - dmin*m
        import gguf  # see _dequantize_blocks

        sc, mins = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scales, offsets = (
            _f16(blocks, 0) * sc.astype(np.float32),
            -(_f16(blocks, 2) * mins.astype(np.float32)),
        )
        return scales, offsets, {0: _F16_ONE, 2: _F16_ZERO, 4: _UNIT_K_SCALES}
    assert kind == _Q.Q6_K  # 128 + 64 bytes of codes, 16 int8 scales, then d: w = d*sc*(q - 32)
    scales = _f16(blocks, 208) * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    return scales, np.zeros_like(scales), {192: bytes([1] * 16), 208: _F16_ONE}


_FLOATS = {_Q.F32: np.float32, _Q.F16: np.float16}
BLOCK_FORMATS = frozenset({_Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K})


def _is_blocks(kind: _Q, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a weight `read_blocks` keeps as codes."""
    return kind in BLOCK_FORMATS and len(shape) == 2


def read_blocks(
    kind: _Q, shape: tuple[int, ...], blocks: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes int8, scales, offsets) as [out_features, in_features (// group)] for a weight of numpy
    `shape` stored as `blocks` ([blocks, bytes per block]) in one of `BLOCK_FORMATS`; None for any other
    type. The codes come from gguf-py's own dequantizer run on unit blocks, so no bit layout is decoded
    twice."""
    if not _is_blocks(kind, shape):
        return None
    scales, offsets, patches = _scales_of(kind, blocks)
    unit = blocks.copy()
    for at, patch in patches.items():
        unit[:, at : at + len(patch)] = np.frombuffer(patch, np.uint8)
    codes = _dequantize_blocks(unit, kind, np.int8)
    out_features = shape[0]
    return codes.reshape(shape), scales.reshape(out_features, -1), offsets.reshape(out_features, -1)


def _unpermute_rope_rows(name: str, config: ModelConfig, weights: np.ndarray) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (llama only) so rows follow HF's rotate_half RoPE layout.

    The converter interleaves each head's two rotary halves (rows [h, 2, d/2] -> [h, d/2, 2]) for
    ggml's pairwise RoPE; swapping the two middle axes back restores HF's [h, 2, d/2] order.
    """
    if not _QK_ROWS.fullmatch(name):
        return weights
    heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
    rows = weights.shape[0]
    grouped = weights.reshape(heads, rows // heads // 2, 2, -1)
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weights.shape)
