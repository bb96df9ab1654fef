"""Llama forward over paged KV.

One call runs a whole step: a flat list of tokens from many sequences (chunked prefill and decode mixed).
Each layer stores the new tokens' K/V into their pool slots, then attends over the pool: decode rows are
batched into one padded SDPA, prefill chunks run one SDPA each. Logits are computed only at the rows that
are sampled, because the LM head is the largest matmul of a prefill step.

Numerics follow HF transformers' Llama (float32 RMSNorm, rotate-half RoPE) so that greedy tokens match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model.gguf import LlamaConfig


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


class LlamaModel:
    def __init__(self, config: LlamaConfig, tensors: dict[str, torch.Tensor]) -> None:
        self.config = config
        embed = tensors["embed_tokens.weight"]
        self.device, self.dtype = embed.device, embed.dtype
        self.embed = embed
        self.lm_head = tensors.get("lm_head.weight", embed)
        self.norm = tensors["norm.weight"]
        self.layers = [self._fuse_layer(tensors, i) for i in range(config.num_layers)]
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim)
        )
        freqs = torch.outer(torch.arange(config.context_length, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1).to(self.device)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _fuse_layer(t: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
        """One matmul for Q/K/V and one for gate/up: fewer kernel launches per layer."""
        p = f"layers.{i}."
        return {
            "in_norm": t[p + "input_layernorm.weight"],
            "post_norm": t[p + "post_attention_layernorm.weight"],
            "qkv": torch.cat([t[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).contiguous(),
            "o": t[p + "self_attn.o_proj.weight"],
            "gate_up": torch.cat([t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"]]).contiguous(),
            "down": t[p + "mlp.down_proj.weight"],
        }

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)

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
        span = inputs.decode_block_tables.shape[1] * kv.shape[3]  # padded keys per decode row
        decode_mask = torch.arange(span, device=self.device) < inputs.decode_context_lens.unsqueeze(1)
        decode_mask = decode_mask.view(len(inputs.decode_rows), 1, 1, span)
        for li, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer["in_norm"])
            q, k, v = (x @ layer["qkv"].T).split([nq * hd, nkv * hd, nkv * hd], dim=-1)
            q = self._rope(q.view(-1, nq, hd), cos, sin)
            k = self._rope(k.view(-1, nkv, hd), cos, sin)
            v = v.view(-1, nkv, hd)
            k_cache, v_cache = kv[li, 0], kv[li, 1]
            k_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, k)
            v_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, v)
            attn = torch.empty_like(q)
            if inputs.decode_rows.numel():
                attn[inputs.decode_rows] = self._decode_attention(
                    q[inputs.decode_rows], k_cache, v_cache, inputs.decode_block_tables, decode_mask
                )
            for seq in inputs.prefills:
                attn[seq.start : seq.end] = self._prefill_attention(q, k, v, k_cache, v_cache, seq)
            h = h + attn.view(-1, nq * hd) @ layer["o"].T
            x = self._rms_norm(h, layer["post_norm"])
            gate, up = (x @ layer["gate_up"].T).chunk(2, dim=-1)
            h = h + (F.silu(gate) * up) @ layer["down"].T
        out = self._rms_norm(h[inputs.logits_rows], self.norm)
        return (out @ self.lm_head.T).float()

    @staticmethod
    def _decode_attention(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """q [D, heads, hd] attends over each row's pages; padded slots are masked out."""
        d, max_pages = block_tables.shape
        ps, nkv, hd = k_cache.shape[1:]
        keys = k_cache[block_tables].view(d, max_pages * ps, nkv, hd).transpose(1, 2)
        values = v_cache[block_tables].view(d, max_pages * ps, nkv, hd).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, enable_gqa=True)
        return out.squeeze(2)

    @staticmethod
    def _prefill_attention(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
    ) -> torch.Tensor:
        qs = q[seq.start : seq.end].transpose(0, 1)
        if seq.block_table is None:
            keys = k[seq.start : seq.end].transpose(0, 1)
            values = v[seq.start : seq.end].transpose(0, 1)
            out = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, enable_gqa=True)
            return out.transpose(0, 1)
        nkv, hd = k_cache.shape[2:]
        n_new, ctx = seq.end - seq.start, seq.context_len
        keys = k_cache[seq.block_table].view(-1, nkv, hd)[:ctx].transpose(0, 1)
        values = v_cache[seq.block_table].view(-1, nkv, hd)[:ctx].transpose(0, 1)
        # Query i sits at position ctx - n_new + i and may see keys up to and including that position.
        mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= torch.arange(
            ctx - n_new, ctx, device=q.device
        ).unsqueeze(1)
        out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, enable_gqa=True)
        return out.transpose(0, 1)
