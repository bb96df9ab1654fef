"""Synthetic GGUF files for benchmarks: a llama-shaped model of any size with random weights, quantized by
gguf-py, and a real model's tokenizer, so that speed can be measured where memory bandwidth decides.

Contract: `synthetic_llama(path, shape, tokenizer_from)` writes (once: an existing file is kept) a GGUF of
architecture llama with `shape`'s sizes, every 2-D weight in `shape.kind` (gguf.quantize), norms F32 ones,
the embedding tied to the output, and the tokenizer keys of `tokenizer_from`. Its answers are noise: only
its speed and its memory mean anything. `benchmark_file(name)` is the file a benchmark's model name means.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from kvfence.model.gguf_file import GGUFFile
from kvfence.pins import PACKAGED_MODELS, default_model_path, packaged_model

_Q = gguf.GGMLQuantizationType
_V = gguf.GGUFValueType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int = 8192
    kind: _Q = _Q.Q4_0

    @property
    def parameters(self) -> int:
        head = self.hidden // self.heads
        attention = self.hidden * (self.heads + 2 * self.kv_heads) * head + self.hidden * self.hidden
        return self.layers * (attention + 3 * self.hidden * self.ffn) + self.vocab * self.hidden


# The 1.07B llama shape of issue 25's table (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192).
LLAMA_1B = Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=49152)
SYNTHETIC = {"llama-1b": LLAMA_1B}  # benchmarks' names for synthetic files (SmolLM2's tokenizer)


def benchmark_file(name: str) -> Path:
    """A packaged model's file, a synthetic one (`SYNTHETIC`, written once into ~/.cache/kvfence-bench), or
    the path `name` itself."""
    if name in PACKAGED_MODELS:
        return packaged_model(name)
    if name in SYNTHETIC:
        path = Path.home() / f".cache/kvfence-bench/{name}-{SYNTHETIC[name].kind.name.lower()}.gguf"
        return synthetic_llama(path, SYNTHETIC[name], default_model_path())
    return Path(name)


def synthetic_llama(path: Path, shape: Shape, tokenizer_from: Path, seed: int = 0) -> Path:
    """The file at `path`, written if missing (under a temporary name, then renamed)."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    writer = gguf.GGUFWriter(partial, "llama")
    _header(writer, shape)
    _tokenizer(writer, GGUFFile(tokenizer_from).metadata)
    rng = np.random.default_rng(seed)
    head = shape.hidden // shape.heads
    kv = shape.kv_heads * head

    def weight(name: str, rows: int, columns: int) -> None:
        values = rng.standard_normal((rows, columns), dtype=np.float32) / np.float32(columns**0.5)
        writer.add_tensor(name, gguf.quants.quantize(values, shape.kind), raw_dtype=shape.kind)

    weight("token_embd.weight", shape.vocab, shape.hidden)
    writer.add_tensor("output_norm.weight", np.ones(shape.hidden, dtype=np.float32))
    for i in range(shape.layers):
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{name}.weight", np.ones(shape.hidden, dtype=np.float32))
        for name, rows, columns in (
            ("attn_q", shape.hidden, shape.hidden),
            ("attn_k", kv, shape.hidden),
            ("attn_v", kv, shape.hidden),
            ("attn_output", shape.hidden, shape.hidden),
            ("ffn_gate", shape.ffn, shape.hidden),
            ("ffn_up", shape.ffn, shape.hidden),
            ("ffn_down", shape.hidden, shape.ffn),
        ):
            weight(f"blk.{i}.{name}.weight", rows, columns)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.rename(path)
    return path


def _header(writer: gguf.GGUFWriter, shape: Shape) -> None:
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_file_type(int(shape.kind))


def _tokenizer(writer: gguf.GGUFWriter, metadata: dict[str, object]) -> None:
    """Every tokenizer key of another file, with its GGUF type."""
    for key, value in metadata.items():
        if not key.startswith("tokenizer."):
            continue
        if isinstance(value, list):
            sub = (
                _V.STRING
                if value and isinstance(value[0], str)
                else _V.FLOAT32
                if "scores" in key
                else _V.INT32
            )
            writer.add_key_value(key, value, _V.ARRAY, sub_type=sub)
        elif isinstance(value, bool):
            writer.add_key_value(key, value, _V.BOOL)
        elif isinstance(value, int):
            writer.add_key_value(key, value, _V.UINT32)
        else:
            writer.add_key_value(key, str(value), _V.STRING)
