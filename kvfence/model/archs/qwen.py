"""qwen2 (Qwen 2 / 2.5: biases on Q, K and V) and qwen3 (Qwen 3: per-head RMSNorm on Q and K, no biases).

Both use NEOX (rotate-half) RoPE, so llama.cpp's converter leaves their Q/K rows as HF has them.
"""

from __future__ import annotations

from kvfence.model.archs.base import BASE_LAYER_TENSORS, QK_NORMS, Architecture, Header, ModelConfig


class _Qwen(Architecture):
    def config(self, header: Header) -> ModelConfig:
        kind = header.rope_scaling()[0]
        if kind != "none":  # e.g. YaRN, for Qwen's long-context variants
            raise ValueError(f"RoPE scaling {kind!r} is unsupported for {self.name}")
        return header.llama_config()


class Qwen2(_Qwen):
    name = "qwen2"
    layer_tensors = BASE_LAYER_TENSORS | {f"attn_{x}.bias" for x in "qkv"}


class Qwen3(_Qwen):
    name = "qwen3"
    layer_tensors = BASE_LAYER_TENSORS | QK_NORMS
