"""transformers as the reference for every architecture kvfence serves: tiny random models built with
transformers' own config and modelling classes, written into GGUF files the way llama.cpp's converter
writes them, and read back into the HF model from the file's bytes (never through kvfence's loader).

`GGUF_NAMES` and `gguf_name` (kvfence.model.hf_dir's, the table its loader reads) map HF parameter names to
GGUF tensor names per architecture; `write_gguf` applies the converter's transformations (llama's
interleaved Q/K rows, Gemma's norms stored as 1 + w) and quantizes with gguf-py, or, for the K-quants
gguf-py cannot quantize, writes random valid blocks (`k_quant_blocks`); `hf_weights_from_file` gives HF the
float32 weights those bytes decode to.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from kvfence.model.hf_dir import GGUF_NAMES, gguf_name, llama3_rope_freqs

__all__ = ["GGUF_NAMES"]  # test_gemma3 reads the table from here

Q = gguf.GGMLQuantizationType
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter on llama's Q/K rows: each head's rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weights.shape)


def llama_cpp_unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    return weights.reshape(heads, weights.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(weights.shape)


def k_quant_blocks(kind: Q, rows: int, columns: int, std: float, seed: int) -> np.ndarray:
    """Random valid K-quant blocks ([rows, bytes per row]) whose weights have about `std`, centred:
    random codes and 6-bit or 8-bit sub-block scales, the float16 super-block scales set so that
    d * scale * code and dmin * min cancel on average (gguf-py only dequantizes K-quants)."""
    block_bytes = gguf.GGML_QUANT_SIZES[kind][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * columns // 256, block_bytes), dtype=np.uint8)

    def set_f16(at: int, value: float) -> None:
        blocks[:, at : at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)

    if kind == Q.Q6_K:  # w = d * int8 scale * (q - 32): centred already
        set_f16(208, 1.0)
    else:  # w = d * scale * q - dmin * min, q up to 15 (Q4_K) or 31 (Q5_K): dmin = d * mean code
        set_f16(0, 1.0)
        set_f16(2, 7.5 if kind == Q.Q4_K else 15.5)
    unit_std = float(gguf.quants.dequantize(blocks, kind).std())
    scale = std / unit_std
    if kind == Q.Q6_K:
        set_f16(208, scale)
    else:
        set_f16(0, scale)
        set_f16(2, scale * (7.5 if kind == Q.Q4_K else 15.5))
    return blocks.reshape(rows, -1)


@dataclass(frozen=True)
class Written:
    """A tiny model written to a GGUF file: the path, and the float32 weights its bytes decode to, under
    HF's names and in HF's layout (what the reference model must run with)."""

    path: Path
    hf_weights: dict[str, torch.Tensor]


def write_gguf(
    path: Path, arch: str, model: torch.nn.Module, kind_of: Callable[[str, np.ndarray], Q], seed: int = 0
) -> Written:
    """Write `model` (an HF causal LM of `arch`) as llama.cpp's converter would, each 2-D weight stored as
    `kind_of(gguf_name, weights)` (1-D tensors always F32)."""
    config = model.config
    writer = gguf.GGUFWriter(path, arch)
    _write_header(writer, arch, config)
    hf_weights: dict[str, torch.Tensor] = {}
    state = model.state_dict()
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    for index, (hf, tensor) in enumerate(state.items()):
        name = gguf_name(arch, hf)
        weights = tensor.detach().float().numpy().copy()
        weights = _to_file(arch, name, weights, config)
        kind = kind_of(name, weights) if weights.ndim == 2 else Q.F32
        stored, decoded = _encode(kind, weights, std=float(weights.std()) or 1.0, seed=seed + index)
        writer.add_tensor(name, stored, raw_dtype=kind if kind not in (Q.F32, Q.F16) else None)
        hf_weights[hf] = torch.from_numpy(_from_file(arch, name, decoded, config))
    if rope_freqs := _llama3_rope_freqs(config):
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Written(path, hf_weights)


def _write_header(writer: gguf.GGUFWriter, arch: str, config: object) -> None:
    c = config
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = c.rope_parameters
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_sliding_window(c.sliding_window)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(head_dim)


def _to_file(arch: str, name: str, weights: np.ndarray, config: object) -> np.ndarray:
    """HF's tensor as the converter stores it."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return weights + 1.0  # Gemma's RMSNorm multiplies by (1 + w): the file holds 1 + w
    if arch == "llama" and re.search(r"attn_[qk]\.weight$", name):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        return llama_cpp_permute(weights, heads)
    return weights


def _from_file(arch: str, name: str, weights: np.ndarray, config: object) -> np.ndarray:
    """The inverse of `_to_file`, on what the stored bytes decode to."""
    if arch == "gemma3" and name.endswith("norm.weight"):
        return weights - 1.0
    if arch == "llama" and re.search(r"attn_[qk]\.weight$", name):
        heads = config.num_attention_heads if "attn_q" in name else config.num_key_value_heads
        return llama_cpp_unpermute(weights, heads)
    return weights


def _encode(kind: Q, weights: np.ndarray, std: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(what the file stores, the float32 weights that decodes to)."""
    if kind == Q.F32:
        return weights, weights
    if kind == Q.F16:
        half = weights.astype(np.float16)
        return half, half.astype(np.float32)
    if kind in K_QUANTS:
        stored = k_quant_blocks(kind, *weights.shape, std=std, seed=seed)
    else:
        stored = gguf.quants.quantize(weights, kind)
    return stored, gguf.quants.dequantize(stored, kind).reshape(weights.shape)


def _llama3_rope_freqs(config: object) -> list[float] | None:
    """What llama.cpp's converter writes as `rope_freqs.weight` for Llama 3's RoPE scaling."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return llama3_rope_freqs(config.to_dict(), head_dim)
