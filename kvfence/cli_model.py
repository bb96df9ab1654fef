"""The model a serving command names, checked before any weight is loaded: its shape from the GGUF header
alone (or a Hugging Face directory's config.json and safetensors headers), what the pool's size and the
window depend on.

Contract: `check_model` returns the shape or raises `StartupError` with one line naming `--model` and the
fix (no such file, not a file, not a usable GGUF file, an architecture kvfence does not serve, not a model
directory); it reads no tensor data and imports numpy only once a model is named. `check_bf16_rows` refuses
`--activation-dtype bfloat16` in one line where the shape holds no bfloat16 weights for it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from kvfence.config import UNBLOCKED_GGML_TYPES, EngineConfig
from kvfence.startup import StartupError, reason


@dataclass(frozen=True)
class ModelShape:
    """What the pool's size and the window depend on (the ModelConfig fields `capacity_report` reads)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    context_length: int
    block_quantized: bool  # any weight stored in a block format (what picks the fast path by default)
    bf16_weights: bool = False  # 2-D weights stored bfloat16, none float16: what bfloat16 rows multiply


def model_shape(metadata: dict[str, object], tensor_kinds: set[int]) -> ModelShape:
    """The shape as the model's architecture reads its header (ValueError for one kvfence does not serve),
    whether any of `tensor_kinds` (ggml type ids) is a block format, and whether the weights are BF16 (the
    rest F32: norms)."""
    from kvfence.model.archs import architecture
    from kvfence.model.archs.base import Header
    from kvfence.model.ggml_types import GGMLType

    architecture(metadata.get("general.architecture"))  # a one-line refusal naming the supported ones
    bf16 = GGMLType.BF16 in tensor_kinds and tensor_kinds <= {GGMLType.F32, GGMLType.BF16}
    return ModelShape(*Header(metadata, {}).kv_shape(), bool(tensor_kinds - UNBLOCKED_GGML_TYPES), bf16)


def check_model(path: Path | None) -> ModelShape:
    """The model's shape, from its GGUF header only (no tensor data)."""
    from kvfence.model.gguf_file import GGUFFile  # numpy only, and only once a model is named
    from kvfence.pins import default_model_path

    if path is None:
        try:
            path = default_model_path()
        except FileNotFoundError as exc:
            raise StartupError(f"--model: {reason(exc)} (or give --model PATH)") from exc
    option = f"--model {path}"
    if not path.exists():
        raise StartupError(f"{option}: no such file; give the path of a GGUF file or a model directory")
    if path.is_dir():
        return hf_model_shape(path)
    if not path.is_file():
        raise StartupError(f"{option}: not a file; give the path of a GGUF file or a model directory")
    try:
        header = GGUFFile(path, arrays=False)
        return model_shape(header.metadata, {tensor.kind for tensor in header.tensors})
    except (OSError, ValueError, struct.error, ZeroDivisionError, OverflowError) as exc:
        raise StartupError(
            f"{option}: not a usable GGUF file ({reason(exc)}); "
            "give a GGUF file (architecture llama, qwen2, qwen3 or gemma3)"
        ) from exc


def hf_model_shape(path: Path) -> ModelShape:
    """A Hugging Face directory's shape, from config.json and the safetensors headers (no tensor data)."""
    from kvfence.model.hf_dir import read_dir

    try:
        hf = read_dir(path)
        config = hf.config
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StartupError(
            f"--model {path}: not a model directory kvfence can serve ({reason(exc)})"
        ) from exc
    stored = {t.dtype for t in hf.tensors.values() if len(t.shape) == 2}
    bf16 = "BF16" in stored and "F16" not in stored
    shape = config.num_layers, config.num_kv_heads, config.head_dim, config.context_length
    return ModelShape(*shape, block_quantized=False, bf16_weights=bf16)


def check_bf16_rows(config: EngineConfig, shape: ModelShape) -> None:
    """`--activation-dtype bfloat16` only where its kernel has weights to multiply (the model refuses it
    too, once loaded: here it is one line before the load)."""
    if config.activation_dtype != "bfloat16":
        return
    why = None
    if not shape.bf16_weights:
        why = "the model holds none (its weights are block-quantized, float16 or float32)"
    elif config.dtype != "float32":
        why = f"--dtype {config.dtype}: they are multiplied under a float32 model"
    if why is not None:
        raise StartupError(
            f"--activation-dtype bfloat16 multiplies a Hugging Face directory's bfloat16 weights: {why}; "
            "use --activation-dtype auto"
        )
