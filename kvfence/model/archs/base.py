"""What an architecture is to kvfence: the hyper-parameters of one GGUF (`ModelConfig`) and the file's own
conventions (`Architecture`), read from the header alone.

Contract: every architecture shares one forward (model/transformer.py), the paged KV, the fence and the
kernels; an `Architecture` only says how its header maps onto `ModelConfig`, which tensors a layer holds,
and whether llama.cpp's converter interleaved the Q/K rows. A header that lacks a key it needs, or a file
with a tensor it does not know, is refused (ValueError) rather than served approximately.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

# The layer tensors every supported architecture has (GGUF names without the "blk.N." prefix).
BASE_LAYER_TENSORS = frozenset(
    f"{name}.weight"
    for name in (
        "attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
        "ffn_norm", "ffn_gate", "ffn_up", "ffn_down",
    )
)  # fmt: skip
QK_NORMS = frozenset({"attn_q_norm.weight", "attn_k_norm.weight"})


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only transformer, as its GGUF header states them.

    The defaults are llama's; the other fields say how an architecture departs from it. A layer in
    `local_layers` attends over its last `sliding_window` positions only, with RoPE base
    `local_rope_theta`; the other (global) layers see the whole context with `rope_theta`."""

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
    architecture: str = "llama"
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embedding_scale: float = 1.0  # Gemma multiplies the embeddings by sqrt(hidden_size)
    query_scale: float = 0.0  # q.k is multiplied by this; 0: head_dim ** -0.5
    rope_linear_factor: float = 1.0  # global layers' positions divided by this (linear RoPE scaling)
    sliding_window: int = 0
    local_layers: frozenset[int] = field(default_factory=frozenset)
    local_rope_theta: float = 0.0

    @property
    def attention_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    def window(self, layer: int) -> int:
        """Positions layer `layer` attends over, its own included; 0 for the whole context."""
        return self.sliding_window if layer in self.local_layers else 0


class Header:
    """A GGUF header: metadata and the tensors' shapes (numpy order, [out_features, in_features])."""

    def __init__(self, metadata: Mapping[str, object], shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.metadata, self.shapes = metadata, shapes
        self.arch = str(metadata.get("general.architecture"))

    def key(self, name: str, default: object = None) -> object:
        """`{arch}.{name}`; a missing key without a default is refused, naming it."""
        value = self.metadata.get(f"{self.arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks required key {self.arch}.{name}")
        return value

    def kv_shape(self) -> tuple[int, int, int, int]:
        """(layers, KV heads, head dim, context length): what the KV pool's size and the window depend on,
        from the metadata alone (no tensor shapes: the start-up check reads only the header's scalars)."""
        heads = int(self.key("attention.head_count"))
        head_dim = int(self.key("attention.key_length", int(self.key("embedding_length")) // heads))
        if int(self.key("attention.value_length", head_dim)) != head_dim:
            raise ValueError("key and value heads of different widths are unsupported")
        if int(self.key("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError(f"partial rotary embeddings (rope dim < head dim {head_dim}) are unsupported")
        kv_heads = int(self.key("attention.head_count_kv", heads))
        return int(self.key("block_count")), kv_heads, head_dim, int(self.key("context_length"))

    def llama_config(self, **overrides: object) -> ModelConfig:
        """The fields every architecture states the same way; `overrides` are an architecture's own."""
        layers, kv_heads, head_dim, context = self.kv_shape()
        fields: dict[str, object] = {
            "vocab_size": self.shapes["token_embd.weight"][0],
            "hidden_size": int(self.key("embedding_length")),
            "intermediate_size": int(self.key("feed_forward_length")),
            "num_layers": layers,
            "num_heads": int(self.key("attention.head_count")),
            "num_kv_heads": kv_heads,
            "head_dim": head_dim,
            "rope_theta": float(self.key("rope.freq_base", 10000.0)),
            "rms_norm_eps": float(self.key("attention.layer_norm_rms_epsilon")),
            "context_length": context,
            "tie_word_embeddings": "output.weight" not in self.shapes,
            "architecture": self.arch,
        }
        return ModelConfig(**(fields | overrides))  # type: ignore[arg-type]

    def rope_scaling(self) -> tuple[str, float]:
        """(type, factor) of the header's RoPE scaling; ("none", 1.0) without one."""
        kind = str(self.key("rope.scaling.type", "none"))
        return kind, float(self.key("rope.scaling.factor", 1.0))


class Architecture(ABC):
    """One GGUF `general.architecture`: how its header reads and which tensors its layers hold."""

    name: str
    permute_qk = False  # llama.cpp's converter interleaves llama's Q/K rows for ggml's pairwise RoPE
    layer_tensors: frozenset[str] = BASE_LAYER_TENSORS
    global_tensors = frozenset({"token_embd.weight", "output_norm.weight", "output.weight"})

    @abstractmethod
    def config(self, header: Header) -> ModelConfig:
        """The model's hyper-parameters; ValueError for a feature of the file this forward lacks."""

    def check_tensors(self, names: set[str], num_layers: int) -> None:
        """Every layer holds exactly `layer_tensors`, and nothing else is in the file: a tensor the forward
        would not read (a bias, an expert) means the model would run without it, so it is refused."""
        expected = {f"blk.{i}.{name}" for i in range(num_layers) for name in self.layer_tensors}
        unknown = sorted(names - expected - self.global_tensors)
        missing = sorted(expected - names) + sorted({"token_embd.weight", "output_norm.weight"} - names)
        if unknown or missing:
            problem = f"unknown tensors {unknown[:4]}" if unknown else f"missing tensors {missing[:4]}"
            raise ValueError(f"not a {self.name} model kvfence can serve: {problem}")
