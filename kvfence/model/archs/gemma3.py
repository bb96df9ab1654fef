"""gemma3: Gemma 3 text models (the 270M..27B decoders).

Departures from llama: embeddings scaled by sqrt(hidden); RMSNorm with weight (1 + w), which llama.cpp's
converter already folded into the stored norm weights (so the plain RMSNorm of the forward is Gemma's);
norms before and after attention and the MLP; a GeGLU MLP (tanh GELU); per-head RMSNorm on Q and K;
q.k scaled by key_length ** -0.5 (27B: (hidden / heads) ** -0.5, HF's query_pre_attn_scalar; llama.cpp tells
27B by its 62 layers); five sliding-window layers (local RoPE base 10000) for every global one.
The header does not carry the pattern or the local base: llama.cpp fixes them for gemma3, as here.
"""

from __future__ import annotations

from kvfence.model.archs.base import BASE_LAYER_TENSORS, QK_NORMS, Architecture, Header, ModelConfig

PATTERN = 6  # every sixth layer is global (llama.cpp: set_swa_pattern(6); HF: sliding_window_pattern)
LOCAL_ROPE_THETA = 10000.0
GEMMA3_27B_LAYERS = 62


class Gemma3(Architecture):
    name = "gemma3"
    layer_tensors = BASE_LAYER_TENSORS | QK_NORMS | {"post_attention_norm.weight", "post_ffw_norm.weight"}

    def config(self, header: Header) -> ModelConfig:
        for unsupported in ("attn_logit_softcapping", "final_logit_softcapping"):
            if header.metadata.get(f"gemma3.{unsupported}"):
                raise ValueError(f"gemma3 {unsupported} is unsupported")
        kind, factor = header.rope_scaling()
        if kind not in ("none", "linear"):
            raise ValueError(f"RoPE scaling {kind!r} is unsupported for gemma3")
        layers = int(header.key("block_count"))
        head_dim = int(header.key("attention.key_length"))
        query_width = int(header.key("embedding_length")) // int(header.key("attention.head_count"))
        return header.llama_config(
            activation="gelu_tanh",
            embedding_scale=float(int(header.key("embedding_length")) ** 0.5),
            query_scale=(query_width if layers == GEMMA3_27B_LAYERS else head_dim) ** -0.5,
            rope_linear_factor=factor,
            sliding_window=int(header.key("attention.sliding_window")),
            local_layers=frozenset(i for i in range(layers) if (i + 1) % PATTERN),
            local_rope_theta=LOCAL_ROPE_THETA,
        )
