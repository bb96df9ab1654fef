"""A model's weights as the forward multiplies them: the loader's GGUF-named tensors bound into fused
projections, per-layer norms, the embedding and the LM head.

Contract: `Binder` reads `tensors` (dense, [out_features, in_features]) and `quantized` (codes); a name is
in one of the two, never both. Each layer gets one Q|K|V projection (with the file's Q/K/V biases, if any),
O, gate|up and down, and the norms it holds (None where its architecture has none). A quantized
projection that fits the packed kernel's panels is held only as packed codes when the kernel runs
(`Projection.dense` None), so no float32 copy of the model stays resident. 16-bit weights under a wider
model, where the 16-bit kernel runs, are held only in its panels (`Projection.half`). Every other
projection is one dense [in_features, out_features] tensor (quantized ones dequantized, on the model's
device, in its dtype; 16-bit weights under a wider model stay 16-bit, as a view of their [out_features,
in_features] rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvfence.model import block_packer
from kvfence.model.gguf import QuantizedWeight, QuantizedWeights
from kvfence.model.half_matmul import HalfWeight
from kvfence.model.packed_matmul import PackedMatmulKernel, PackedWeight


@dataclass(frozen=True)
class Projection:
    """One (fused) weight: `packed` for the packed kernel, `half` for the 16-bit one, else `dense` ([in,
    out], BLAS's `x @ w`); exactly one of the three. `bias` [out] is added after the matmul, whichever path
    ran."""

    dense: torch.Tensor | None
    packed: PackedWeight | None
    bias: torch.Tensor | None = None
    half: HalfWeight | None = None


@dataclass(frozen=True)
class Layer:
    """One decoder block. Norms named as GGUF names them: `attn_norm` before attention, `ffn_norm` before
    the MLP; Gemma's `post_attn_norm` / `post_ffn_norm` on each branch's output, Qwen 3's and Gemma's
    `q_norm` / `k_norm` on each head before RoPE."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None
    post_ffn_norm: torch.Tensor | None = None

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o, self.gate_up, self.down


class Binder:
    """Reads the named weights out of the loader's two dicts, packed where `kernel` runs (laid out for its
    int8 dot products where `dot` and the codes allow: `pack`); 16-bit weights under a wider model in the
    16-bit kernel's panels where `half` (that kernel runs), in pairs for bfloat16 rows where `pairs`."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        quantized: Mapping[str, QuantizedWeight],
        kernel: PackedMatmulKernel | None,
        dot: bool = False,
        half: bool = False,
        pairs: bool = False,
    ) -> None:
        both = sorted(tensors.keys() & quantized.keys())
        if both:
            raise ValueError(f"weights given both dense and quantized: {both[:4]}")
        self.tensors, self.quantized, self.kernel, self.dot, self.half = tensors, quantized, kernel, dot, half
        self.pairs = pairs
        norm = tensors["output_norm.weight"]  # never quantized: its dtype and device are the model's
        self.dtype, self.device = norm.dtype, norm.device

    def dense(self, name: str) -> torch.Tensor:
        """[out, in] in the model's dtype, on its device (dequantized if stored quantized)."""
        if name in self.tensors:
            return self.tensors[name]
        return self.quantized[name].dequantize().to(self.dtype).to(self.device)

    def pack(self, names: Sequence[str], dot: bool) -> PackedWeight | None:
        """The quantized weights `names` as one PackedWeight (None where PackedWeight.pack gives none):
        straight from the file's blocks where block_packer takes them (weights read from a file, all of one
        format), else from their codes."""
        packer, stored = block_packer.load(), self.quantized
        if packer is not None and isinstance(stored, QuantizedWeights) and all(n in stored for n in names):
            with stored.stored(names) as parts:
                packed = packer.pack(parts, dot)
            if packed is not None:
                return packed
        return PackedWeight.pack([self.quantized.get(name) for name in names], dot)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.tensors.get(name)

    def projection(self, names: Sequence[str]) -> Projection:
        """The weights `names` stacked along output features: packed if every one is quantized and the
        kernel runs, else dense. Biases ("<name>.bias" beside "<name>.weight") stacked likewise."""
        packed = None
        if self.kernel is not None:
            packed = self.pack(names, self.dot)
        dense = half = None
        if packed is None:
            dense, half = self._unpacked(names)
        biases = [self.tensors.get(name.removesuffix(".weight") + ".bias") for name in names]
        bias = torch.cat(biases) if all(b is not None for b in biases) else None  # type: ignore[misc]
        if bias is None and any(b is not None for b in biases):
            raise ValueError(f"biases on only some of {list(names)}")
        return Projection(dense, packed, bias, half)

    def _unpacked(self, names: Sequence[str]) -> tuple[torch.Tensor | None, HalfWeight | None]:
        """(dense, half): 16-bit weights under a wider model in the 16-bit kernel's panels where it runs,
        else a dense [in, out]: contiguous for BLAS, or the transposed view of 16-bit [out, in] rows (torch
        widens them for each call)."""
        weights = torch.cat([self.dense(n) for n in names])
        if weights.dtype == self.dtype:
            return weights.T.contiguous(), None
        return (None, HalfWeight.from_rows(weights, self.pairs)) if self.half else (weights.T, None)

    def layer(self, i: int) -> Layer:
        p = f"blk.{i}."
        return Layer(
            attn_norm=self.tensors[p + "attn_norm.weight"],
            ffn_norm=self.tensors[p + "ffn_norm.weight"],
            qkv=self.projection([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"]),
            o=self.projection([p + "attn_output.weight"]),
            gate_up=self.projection([p + "ffn_gate.weight", p + "ffn_up.weight"]),
            down=self.projection([p + "ffn_down.weight"]),
            q_norm=self.optional(p + "attn_q_norm.weight"),
            k_norm=self.optional(p + "attn_k_norm.weight"),
            post_attn_norm=self.optional(p + "post_attention_norm.weight"),
            post_ffn_norm=self.optional(p + "post_ffw_norm.weight"),
        )

    def lm_head(self) -> Projection:
        """The output projection: `output.weight`, or the embedding when the file ties the two. Dense, it
        is a transposed view ([hidden, vocab]) of the [vocab, hidden] table: no second copy."""
        name = (
            "output.weight"
            if "output.weight" in self.tensors.keys() | self.quantized.keys()
            else "token_embd.weight"
        )
        packed = self.pack([name], self.dot) if self.kernel is not None else None
        if packed is not None:
            return Projection(None, packed)
        weight = self.dense(name)
        if self.half and weight.dtype != self.dtype:
            return Projection(None, None, half=HalfWeight.from_rows(weight, self.pairs))
        return Projection(weight.T, None)


class Embedding:
    """Token embeddings from whichever copy the model already holds: the LM head's when the file ties the
    two (its packed rows, its 16-bit panels' rows, or its dense table). Untied, the file's table packed as
    the kernel's panels are (0.56-0.75 bytes a weight for 4-bit formats, where its int8 codes and float32
    scales took 1.25), else its codes, else its dense table. Packed rows are, bit for bit, the dequantized
    ones (`PackedWeight`)."""

    def __init__(self, binder: Binder, lm_head: Projection, tied: bool) -> None:
        self.dtype, self.device = binder.dtype, binder.device
        self._packed, self._quantized = lm_head.packed if tied else None, None
        self._half = lm_head.half if tied else None
        if not tied and "token_embd.weight" in binder.quantized:
            self._packed = binder.pack(["token_embd.weight"], dot=False)
            if self._packed is None:
                self._quantized = binder.quantized["token_embd.weight"]
        self._dense = None
        if self._packed is None and self._quantized is None and self._half is None:
            self._dense = (
                lm_head.dense.T if tied and lm_head.dense is not None else binder.dense("token_embd.weight")
            )

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if self._dense is not None:
            return self._dense[ids].to(self.dtype)  # 16-bit tables widen here, a row at a time
        if self._half is not None:
            return self._half.rows(ids.cpu()).to(self.dtype).to(self.device)
        source = self._packed.rows if self._packed is not None else self._quantized.dequantize  # type: ignore[union-attr]
        return source(ids.cpu()).to(self.dtype).to(self.device)
