"""Load a llama-architecture GGUF file into HF-named float tensors.

Contract: `load_gguf` returns every tensor dequantized, in torch Linear layout ([out_features, in_features]),
named as in HF's `Transformer` without the "model." prefix, with the Q/K rows restored to HF's rotate_half
RoPE order. The result is bit-identical (in float32) to what transformers loads from the same file.
Weights stored in a 32-weight block format (Q4_0, Q4_1, Q8_0) are also kept as their codes, scales and
offsets (`GGUFModel.quantized`), rows in the same order, for the decode-matmul kernel.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch

# GGUF tensor name -> HF name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(.+)")
_Q = gguf.GGMLQuantizationType
_BLOCK_FORMATS = (_Q.Q4_0, _Q.Q4_1, _Q.Q8_0)  # code * scale (+ offset) per 32 weights: QuantizedWeight
_PROGRESS_REPORTS = 6  # progress lines per load: a few layers apart, not one per tensor


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a llama model, as the GGUF header states them."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    context_length: int
    tie_word_embeddings: bool


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight as the GGUF stores it: w[n, k] = codes[n, k] * scales[n, k // 32] + offsets[n, k // 32].

    In float32 that is bit for bit the dequantized tensor (the product of a code and a half-precision
    scale is exact; the add rounds once, as the reference dequantizer's does). Kept for the formats of
    that shape: Q4_0, Q4_1 and Q8_0, whose blocks are 32 weights."""

    codes: torch.Tensor  # [out_features, in_features] int8
    scales: torch.Tensor  # [out_features, in_features // 32] float32
    offsets: torch.Tensor  # [out_features, in_features // 32] float32


@dataclass
class GGUFModel:
    """A loaded GGUF: config, HF-named tensors, all key/value metadata as python values, and for the
    weights stored in a block format `QuantizedWeight` knows, their codes (CPU tensors)."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, object]
    path: Path
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


@functools.cache
def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
) -> GGUFModel:
    """Read, dequantize (to float32, then `dtype`) and place on `device` every tensor of a llama GGUF.

    Raises ValueError for a non-llama architecture or a tensor this loader does not know (e.g. biases,
    MoE experts, llama3 `rope_freqs`), rather than silently dropping weights the model would need.
    The quantized codes are kept only for float32 on CPU, the one case the packed kernel serves.
    """
    path = Path(path)
    report = progress or (lambda _message: None)
    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    metadata = _read_metadata(reader)
    config = _config_from(metadata, reader)
    report(f"{path.name}: header read, {len(reader.tensors)} tensors, {config.num_layers} layers")
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    keep_codes = dtype == torch.float32 and torch.device(device).type == "cpu"
    report_every = max(1, len(reader.tensors) // _PROGRESS_REPORTS)
    for done, tensor in enumerate(reader.tensors, start=1):
        name = _hf_name(tensor.name)
        weights = _unpermute_rope_rows(name, _dequantize(tensor), config)
        tensors[name] = torch.from_numpy(weights).to(dtype=dtype, device=device)
        blocks = read_blocks(tensor) if keep_codes else None
        if blocks is not None:
            codes, scales, offsets = (_unpermute_rope_rows(name, part, config) for part in blocks)
            quantized[name] = QuantizedWeight(*(torch.from_numpy(part) for part in (codes, scales, offsets)))
        if done % report_every == 0 or done == len(reader.tensors):
            report(f"{path.name}: {done}/{len(reader.tensors)} tensors ({time.perf_counter() - start:.1f}s)")
    return GGUFModel(config=config, tensors=tensors, metadata=metadata, path=path, quantized=quantized)


def read_header(path: str | Path) -> tuple[ModelConfig, dict[str, object]]:
    """Config and metadata without reading any tensor data (enough for a tokenizer: the router)."""
    reader = gguf.GGUFReader(Path(path))
    metadata = _read_metadata(reader)
    return _config_from(metadata, reader), metadata


def _read_metadata(reader: gguf.GGUFReader) -> dict[str, object]:
    """Every key/value pair of the file; the "GGUF.*" header pseudo-fields are not metadata."""
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _config_from(metadata: dict[str, object], reader: gguf.GGUFReader) -> ModelConfig:
    """Build the config from `{arch}.*` keys; vocab size comes from the embedding matrix itself."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}: only 'llama' models can be loaded")

    def key(name: str) -> object:
        if f"{arch}.{name}" not in metadata:
            raise ValueError(f"GGUF metadata lacks required key {arch}.{name}")
        return metadata[f"{arch}.{name}"]

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    rope_dim = int(metadata.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) unsupported")
    names = {tensor.name: tensor for tensor in reader.tensors}
    return ModelConfig(
        vocab_size=int(names["token_embd.weight"].shape[1]),  # ggml shape is [hidden, vocab]
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(metadata.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        context_length=int(key("context_length")),
        tie_word_embeddings="output.weight" not in names,
    )


def _hf_name(gguf_name: str) -> str:
    """Map a GGUF tensor name to its HF name, or raise for one the llama model has no slot for."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    raise ValueError(f"unsupported tensor {gguf_name!r} in GGUF file (not a plain llama weight)")


def _dequantize(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Float32 array in numpy order, which is ggml's dim order reversed, i.e. [out_features, in_features]."""
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    weights = weights.reshape(tuple(reversed(tensor.shape.tolist())))
    # F32 tensors come back as views of the read-only memory map; torch needs memory it may own.
    return weights if weights.flags.writeable else weights.copy()


def read_blocks(tensor: gguf.ReaderTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(codes int8, scales, offsets) as [out_features, in_features (// 32)] for a Q4_0, Q4_1 or Q8_0
    tensor, None for any other type. The block layouts are ggml's: a float16 scale `d` (Q4_1: then a
    float16 offset `m`), then the codes; 4-bit codes hold weight j in the low nibble of byte j and
    weight j + 16 in its high nibble, and Q4_0 codes are stored plus 8."""
    kind = tensor.tensor_type
    if kind not in _BLOCK_FORMATS:
        return None
    out_features, in_features = reversed(tensor.shape.tolist())
    blocks = np.asarray(tensor.data).reshape(out_features * in_features // 32, -1)
    scales = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    offsets = np.zeros_like(scales)
    if kind == _Q.Q8_0:
        codes = blocks[:, 2:].copy().view(np.int8)
    else:
        packed = blocks[:, 4:] if kind == _Q.Q4_1 else blocks[:, 2:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.int8)
        if kind == _Q.Q4_1:
            offsets = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        else:
            codes -= 8
    return (
        codes.reshape(out_features, in_features),
        scales.reshape(out_features, in_features // 32),
        offsets.reshape(out_features, in_features // 32),
    )


def _unpermute_rope_rows(name: str, weights: np.ndarray, config: ModelConfig) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation so rows follow HF's rotate_half RoPE layout.

    The converter interleaves each head's two rotary halves (rows [h, 2, d/2] -> [h, d/2, 2]) for
    ggml's pairwise RoPE; swapping the two middle axes back restores HF's [h, 2, d/2] order.
    """
    if name.endswith("self_attn.q_proj.weight"):
        heads = config.num_heads
    elif name.endswith("self_attn.k_proj.weight"):
        heads = config.num_kv_heads
    else:
        return weights
    out_features, in_features = weights.shape
    grouped = weights.reshape(heads, out_features // heads // 2, 2, in_features)
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(out_features, in_features)
