"""llama: Llama 1-3.x, Mistral 7B, SmolLM (llama.cpp writes all of them with this architecture).

Llama 3.x's RoPE scaling arrives as the tensor `rope_freqs.weight`, the per-frequency divisors llama.cpp's
converter computed from `rope_scaling` (type llama3); the forward divides RoPE's inverse frequencies by it.
"""

from __future__ import annotations

from kvfence.model.archs.base import Architecture, Header, ModelConfig


class Llama(Architecture):
    name = "llama"
    permute_qk = True
    global_tensors = Architecture.global_tensors | {"rope_freqs.weight"}

    def config(self, header: Header) -> ModelConfig:
        kind, factor = header.rope_scaling()
        if kind == "linear":
            return header.llama_config(rope_linear_factor=factor)
        if kind != "none":
            raise ValueError(f"RoPE scaling {kind!r} is unsupported (llama: none, linear, llama3 freqs)")
        return header.llama_config()
