"""The roofline context of a served row: the work a prefill and a decode step do on a GGUF model, and what
rate a measured TTFT and TPOT make of it.

Contracts (the counts are the model's, not any engine's): `prefill_flops` = 2 x matmul weights x prompt
tokens (the embedding lookup and the last position's output projection left out) + attention's 4 x heads
x head_dim x prompt^2 / 2 per layer (q.k and p.v over the causal half; a sliding-window layer over at most
its window); `decode_bytes` =
every weight as the file stores it (a step reads each once; a tied output reads the embedding) + the K/V a
step reads at `context` tokens (float16 unless `kv_bytes` says otherwise; a windowed layer at most its
window). `achieved` divides them by the measured seconds: GFLOPS over TTFT, GB/s over TPOT.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvfence.model.archs.base import ModelConfig
from kvfence.model.ggml_types import BLOCK_GEOMETRY, GGMLType
from kvfence.model.gguf import read_header
from kvfence.model.gguf_file import GGUFFile

# Not in a prompt token's matmuls: the embedding is a lookup, the output projection runs for the last
# position only (where a tied model reads the embedding instead).
NOT_PER_TOKEN = frozenset({"token_embd.weight", "output.weight"})


@dataclass(frozen=True)
class ModelWork:
    config: ModelConfig
    matmul_params: int  # weights of the matmuls a prefill token goes through
    weight_bytes: int  # every tensor as stored in the file

    def prefill_flops(self, prompt: int) -> float:
        c = self.config
        attention = sum(
            4 * c.num_heads * c.head_dim * _causal_pairs(prompt, c.window(layer))
            for layer in range(c.num_layers)
        )
        return 2.0 * self.matmul_params * prompt + attention

    def decode_bytes(self, context: int, kv_bytes: int = 2) -> float:
        c = self.config
        read = sum(min(context, c.window(layer) or context) for layer in range(c.num_layers))
        return float(self.weight_bytes + read * 2 * c.num_kv_heads * c.head_dim * kv_bytes)


def _causal_pairs(prompt: int, window: int) -> float:
    """(query, key) pairs a causal prompt attends: prompt^2 / 2, or about prompt x window in a window."""
    return prompt * min(prompt, window) - min(prompt, window) ** 2 / 2 if window else prompt**2 / 2


def model_work(path: Path) -> ModelWork:
    """The counts of the GGUF file at `path`, from its header (no tensor data read)."""
    config, _ = read_header(path)
    file = GGUFFile(path, arrays=False)
    matmuls = sum(t.elements for t in file.tensors if len(t.shape) == 2 and t.name not in NOT_PER_TOKEN)
    stored = sum(_stored_bytes(t.kind, t.elements) for t in file.tensors)
    return ModelWork(config, matmuls, stored)


def _stored_bytes(kind: int, elements: int) -> int:
    weights, nbytes = BLOCK_GEOMETRY[GGMLType(kind)]
    return elements // weights * nbytes


def achieved(work: float, seconds: float, unit: float = 1e9) -> float:
    """`work` per second in `unit`s (1e9: GFLOPS or GB/s); 0 when nothing was measured."""
    return work / seconds / unit if seconds > 0 else 0.0
