"""Llama forward over paged KV.

One call runs a whole step: a flat list of tokens from many sequences (chunked prefill and decode mixed).
Each layer stores the new tokens' K/V into their pool slots, then attends over the pool: decode rows run
through the paged-attention kernel, in place (C on CPU, Triton on CUDA; where neither runs: one padded
SDPA over gathered pages), and prefill chunks run one SDPA each. Decode rows multiply by the GGUF's
quantized weights in a C kernel (the same float32 weights in a third of the bytes; where it cannot run,
BLAS over the dense copy), the other rows by BLAS. Logits are computed only at the rows that are
sampled, because the LM head is the largest matmul of a prefill step.

Numerics follow HF transformers' Llama (float32 RMSNorm, rotate-half RoPE) so that greedy tokens match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvfence.config import DECODE_ATTENTION, DECODE_MATMUL
from kvfence.model import packed_matmul, paged_kernel, triton_attention
from kvfence.model.gguf import GGUFModel, ModelConfig, QuantizedWeight
from kvfence.model.packed_matmul import PackedWeight
from kvfence.model.paged_decode import PagedDecode

K = TypeVar("K")


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight`, with a lone row computed as a two-row GEMM.

    With [in, out] weights, BLAS takes a GEMV path for one row that rounds differently from the GEMM path
    used for two or more, where a row's result is (measured) almost always bit-identical whatever the row
    count. Duplicating a lone row keeps a solo decode's logits equal to the same request's batched ones
    (batched == solo is the oracle the fence tests lean on) for ~10 ms per solo step."""
    if x.shape[0] == 1:
        return (x.expand(2, -1) @ weight)[:1]
    return x @ weight


@dataclass(frozen=True)
class Projection:
    """One (fused) weight: `dense`, the float tensor BLAS multiplies ([in, out] in the layers; the LM head
    keeps its embedding layout, [vocab, hidden]) and, when the GGUF stores it quantized and the packed
    kernel runs, `packed` for decode rows."""

    dense: torch.Tensor
    packed: PackedWeight | None


@dataclass(frozen=True)
class Layer:
    in_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection

    def projections(self) -> tuple[Projection, ...]:
        return self.qkv, self.o, self.gate_up, self.down


@dataclass
class PrefillSeq:
    """A prefill chunk: tokens [start, end) of the step, attending over `context_len` cached+new tokens.

    `block_table` is None when the chunk is the whole context (nothing cached): K/V then come straight
    from the step and attention is plainly causal."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat slot (page * page_size + offset) for each new token's K/V
    decode_rows: torch.Tensor  # [D] indices into T of single-token decode rows
    decode_block_tables: torch.Tensor  # [D, max_pages]
    decode_context_lens: torch.Tensor  # [D] tokens each decode row attends over (new one included)
    prefills: list[PrefillSeq]
    logits_rows: torch.Tensor  # [S] indices into T whose logits are returned


class Transformer:
    """`quantized` (GGUFModel.quantized) holds the GGUF's codes of the weights in `tensors`; without it,
    or with `decode_matmul="dense"`, every matmul runs on BLAS."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        decode_attention: str = "auto",
        quantized: dict[str, QuantizedWeight] | None = None,
        decode_matmul: str = "auto",
    ) -> None:
        self.config = config
        embed = tensors["embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        self._kernel, self.decode_attention_note = self._choose_kernel(
            "decode attention", decode_attention, DECODE_ATTENTION, self._attention_loader()
        )
        self.decode_attention = "kernel" if self._kernel else "sdpa"
        quantized = quantized or {}
        self._packed_kernel, self.decode_matmul_note = self._choose_kernel(
            "decode matmul",
            decode_matmul,
            DECODE_MATMUL,
            self._on_cpu_float32(packed_matmul.load)
            if quantized
            else lambda: (None, "the weights are not stored quantized"),
        )
        self.embed = embed
        lm_head = "lm_head.weight" if "lm_head.weight" in tensors else "embed_tokens.weight"
        self.lm_head = Projection(tensors[lm_head], self._pack(quantized, [lm_head]))
        self.norm = tensors["norm.weight"]
        self.layers = [self._fuse_layer(tensors, quantized, i) for i in range(config.num_layers)]
        packed = [self.lm_head.packed] + [p.packed for layer in self.layers for p in layer.projections()]
        if self._packed_kernel is not None and not any(packed):
            if decode_matmul == "kernel":
                raise ValueError("decode matmul 'kernel' is unavailable: no weight fits its panels")
            self._packed_kernel, self.decode_matmul_note = None, "no weight fits the kernel's panels"
        self.decode_matmul = "kernel" if self._packed_kernel else "dense"
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        freqs = torch.outer(torch.arange(config.context_length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @classmethod
    def from_gguf(
        cls, gguf: GGUFModel, decode_attention: str = "auto", decode_matmul: str = "auto"
    ) -> Transformer:
        return cls(gguf.config, gguf.tensors, decode_attention, gguf.quantized, decode_matmul)

    def _choose_kernel(
        self, what: str, choice: str, choices: tuple[str, ...], load: Callable[[], tuple[K | None, str]]
    ) -> tuple[K | None, str]:
        """The kernel `choice` ("auto", "kernel" or the torch path, choices[2]) asks for and, when it is not
        used, why. `load` says whether it runs here; "kernel" insists: no silent fallback."""
        if choice not in choices:
            raise ValueError(f"{what} must be one of {choices}, not {choice!r}")
        if choice == choices[2]:
            return None, "chosen"
        kernel, why = load()
        if kernel is None and choice == "kernel":
            raise ValueError(f"{what} 'kernel' is unavailable: {why}")
        return kernel, why

    def _on_cpu_float32(self, load: Callable[[], tuple[K | None, str]]) -> Callable[[], tuple[K | None, str]]:
        """`load`, for the C kernels: they run float32 on CPU only."""

        def checked() -> tuple[K | None, str]:
            if self.device.type != "cpu" or self.dtype != torch.float32:
                return None, f"the kernel runs float32 on CPU, not {self.dtype} on {self.device}"
            return load()

        return checked

    def _attention_loader(self) -> Callable[[], tuple[PagedDecode | None, str]]:
        """The device seam of decode attention: the C kernel on CPU, the Triton kernel on CUDA (the same
        arguments, the same float32-accumulated result, each row alone)."""
        if self.device.type == "cuda":
            return lambda: triton_attention.load(self.device.type)
        return self._on_cpu_float32(paged_kernel.load)

    def _pack(self, quantized: dict[str, QuantizedWeight], names: Sequence[str]) -> PackedWeight | None:
        if self._packed_kernel is None:
            return None
        return PackedWeight.pack([quantized.get(name) for name in names])

    def _fuse_layer(self, t: dict[str, torch.Tensor], quantized: dict[str, QuantizedWeight], i: int) -> Layer:
        """One matmul for Q/K/V and one for gate/up: fewer kernel launches per layer.

        Dense weights are stored transposed, [in, out] contiguous, and applied as `x @ w`: with 16 rows
        (a decode batch) and two threads, MKL runs a layer's matmuls in 0.8 ms that way against 3.4 ms
        for `x @ W.T` over the [out, in] original (measured; equal at one thread and for prefill-sized
        inputs)."""
        p = f"layers.{i}."

        def fused(*names: str) -> Projection:
            keys = [p + name + ".weight" for name in names]
            return Projection(torch.cat([t[key] for key in keys]).T.contiguous(), self._pack(quantized, keys))

        return Layer(
            in_norm=t[p + "input_layernorm.weight"],
            post_norm=t[p + "post_attention_layernorm.weight"],
            qkv=fused("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            o=fused("self_attn.o_proj"),
            gate_up=fused("mlp.gate_proj", "mlp.up_proj"),
            down=fused("mlp.down_proj"),
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the weights' dtype, as HF does; F.rms_norm is one fused kernel, and in
        # float32 applying the weight inside it is bit-identical to HF's `weight * normed` (checked).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.config.rms_norm_eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv: torch.Tensor) -> torch.Tensor:
        """Run one step; `kv` is the pool tensor [layers, 2, pages, page_size, kv_heads, head_dim].
        Returns float32 logits [S, vocab] for `inputs.logits_rows`."""
        cfg = self.config
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = self.embed[inputs.input_ids]
        cos, sin = self.cos[inputs.positions].unsqueeze(1), self.sin[inputs.positions].unsqueeze(1)
        decode_mask = None if self._kernel else self._padding_mask(inputs, kv.shape[3])
        for li, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.in_norm)
            qkv = self._linear(x, layer.qkv, inputs).view(-1, nq + 2 * nkv, hd)
            q, k = self._rope(qkv[:, : nq + nkv], cos, sin).split([nq, nkv], dim=1)  # one RoPE for Q and K
            v = qkv[:, nq + nkv :]
            k_cache, v_cache = kv[li, 0], kv[li, 1]
            k_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, k)
            v_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, v)
            if not inputs.prefills:  # a pure decode step: every row is a decode row, in order
                attn = self._decode_attention(q, k_cache, v_cache, inputs, decode_mask)
            else:
                attn = torch.empty_like(q)
                if inputs.decode_rows.numel():
                    attn[inputs.decode_rows] = self._decode_attention(
                        q[inputs.decode_rows], k_cache, v_cache, inputs, decode_mask
                    )
                for seq in inputs.prefills:
                    attn[seq.start : seq.end] = self._prefill_attention(q, k, v, k_cache, v_cache, seq)
            h = h + self._linear(attn.view(-1, nq * hd), layer.o, inputs)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = self._linear(x, layer.gate_up, inputs).chunk(2, dim=-1)
            h = h + self._linear(F.silu(gate) * up, layer.down, inputs)
        out = self._rms_norm(h[inputs.logits_rows], self.norm)
        if self.lm_head.packed is not None and self._packed_kernel is not None:
            return self._packed_kernel(out, self.lm_head.packed)  # every logits row, every step: see _linear
        # [vocab, hidden] @ [hidden, S]: the weight's own layout (it is tied to the embedding, so a
        # transposed copy would cost another 113 MB) and as fast as the transposed form for few rows.
        return (self.lm_head.dense @ out.T).T.float()

    def _linear(self, x: torch.Tensor, weight: Projection, inputs: StepInputs) -> torch.Tensor:
        """`x @ weight`: decode rows through the packed kernel, the other rows through BLAS.

        A decode row takes the kernel in every step, pure decode or mixed with prefill chunks, and the
        kernel computes each row alone: so a request's decode arithmetic does not depend on what it is
        batched with (batched == solo, the oracle the fence tests lean on). In a mixed step BLAS runs
        over every row and the decode rows are then overwritten: a few wasted rows cost less than
        copying the prefill rows out and their results back (W2 at concurrency 16: 31.2 s with the
        copies, 23.4 s without, in two runs)."""
        if weight.packed is None or self._packed_kernel is None or not inputs.decode_rows.numel():
            return _matmul(x, weight.dense)
        if not inputs.prefills:  # every row is a decode row
            return self._packed_kernel(x, weight.packed)
        out = _matmul(x, weight.dense)
        out[inputs.decode_rows] = self._packed_kernel(x[inputs.decode_rows], weight.packed)
        return out

    @staticmethod
    def _gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """The pages named by `block_tables` [..., n] as [..., n * page_size, kv_heads, head_dim].

        index_select over whole flattened pages copies one contiguous run per page: ~3.5x faster than
        advanced indexing `cache[block_tables]`, which walks the trailing dims element by element."""
        ps, nkv, hd = cache.shape[1:]
        pages = cache.view(cache.shape[0], -1).index_select(0, block_tables.flatten())
        return pages.view(*block_tables.shape[:-1], block_tables.shape[-1] * ps, nkv, hd)

    @staticmethod
    def _padding_mask(inputs: StepInputs, page_size: int) -> torch.Tensor:
        """[D, 1, 1, span]: which of a decode row's gathered (padded) key slots hold its context."""
        span = inputs.decode_block_tables.shape[1] * page_size
        lens = inputs.decode_context_lens
        mask = torch.arange(span, device=lens.device) < lens[:, None]
        return mask.view(len(inputs.decode_rows), 1, 1, span)

    def _decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        inputs: StepInputs,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """q [D, heads, hd] attends over each row's pages: in place with the kernel, else gathered + SDPA
        (`mask` hides the padding of the gathered copy)."""
        if self._kernel is not None:
            return self._kernel(q, k_cache, v_cache, inputs.decode_block_tables, inputs.decode_context_lens)
        assert mask is not None
        keys = self._gather_pages(k_cache, inputs.decode_block_tables).transpose(1, 2)
        values = self._gather_pages(v_cache, inputs.decode_block_tables).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
        return out.squeeze(2)

    @classmethod
    def _prefill_attention(
        cls,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
    ) -> torch.Tensor:
        # SDPA gets a batch dim of 1: on CPU only 4-D inputs reach the fused flash kernel (~3x faster for
        # a 512-token chunk than the 3-D fallback, which materialises the score matrix).
        qs = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
        if seq.block_table is None:
            keys = k[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            values = v[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
            return out[0].transpose(0, 1)
        n_new, ctx = seq.end - seq.start, seq.context_len
        keys = cls._gather_pages(k_cache, seq.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
        values = cls._gather_pages(v_cache, seq.block_table)[:ctx].transpose(0, 1).unsqueeze(0)
        # Query i sits at position ctx - n_new + i and may see keys up to and including that position.
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= torch.arange(
            ctx - n_new, ctx, device=q.device
        ).unsqueeze(1)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
        return out[0].transpose(0, 1)
