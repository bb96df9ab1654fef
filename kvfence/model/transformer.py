"""The decoder-only transformer forward over paged KV, for every architecture in `archs`.

One call runs a whole step: a flat list of tokens from many sequences (chunked prefill and decode mixed).
Each layer stores the new tokens' K/V into their pool slots, then attends over the pool (attention.py):
decode rows through the paged-attention kernel, in place (C on CPU, Triton on CUDA; where neither runs:
one padded SDPA over gathered slots, the pool's zero page past each row's context), prefill chunks through
the C prefill kernel where the C decode kernel runs (each query row computed from its position and the pool
alone: a prompt's logits do not depend on its chunking; with int8 activations on AVX512-BF16 its q . k and
p . v run in bf16, csrc/prefill_bf16.h), else one SDPA each. Every row, prefill and decode,
multiplies by the GGUF's quantized weights in a C kernel (the same float32 weights in about a third of the
bytes, and the only copy of them: weights.py). Logits are
computed only at the rows that are sampled, because the LM head is the largest matmul of a prefill step.

Architectures differ only in what `ModelConfig` and the layer's tensors say: Q/K/V biases (Qwen 2), per-head
Q/K norms (Qwen 3, Gemma 3), norms after each branch, a scaled embedding and GeGLU (Gemma 3), per-layer
sliding windows and RoPE bases (Gemma 3), RoPE frequency factors (Llama 3). Numerics follow HF
transformers' modelling code (float32 RMSNorm, rotate-half RoPE) so that greedy tokens match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch
import torch.nn.functional as F

from kvfence.config import ACTIVATION_DTYPES, DECODE_ATTENTION, DECODE_MATMUL
from kvfence.model import attention, half_matmul, packed_matmul, paged_kernel, triton_attention
from kvfence.model.attention import LayerAttention, PrefillSeq
from kvfence.model.decoder_layer import DecoderLayers, StepBuffers
from kvfence.model.gguf import GGUFModel, ModelConfig, QuantizedWeight
from kvfence.model.half_matmul import HALF_DTYPES, HalfMatmulKernel
from kvfence.model.packed_matmul import PackedMatmulKernel
from kvfence.model.paged_decode import PagedDecode
from kvfence.model.paged_kernel import PagedDecodeKernel
from kvfence.model.weights import Binder, Embedding, Layer, Projection

K = TypeVar("K")
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def _matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x @ weight`, with a lone row computed as a two-row GEMM.

    With [in, out] weights, BLAS takes a GEMV path for one row that rounds differently from the GEMM path
    used for two or more, where a row's result is (measured) almost always bit-identical whatever the row
    count. Duplicating a lone row keeps a solo decode's logits equal to the same request's batched ones
    (batched == solo is the oracle the fence tests lean on) for ~10 ms per solo step."""
    if x.shape[0] == 1:
        return (x.expand(2, -1) @ weight)[:1]
    return x @ weight


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
    # A page of `kv` that holds zeros (KVPool.zero_page): the torch decode path reads it for every slot past
    # a row's context. None only for a step without decode rows.
    zero_page: int | None


def _logits_rows_out(
    c_layers: DecoderLayers,
    cfg: ModelConfig,
    buffers: StepBuffers,
    kv: torch.Tensor,
    h: torch.Tensor,
    rows: torch.Tensor,
) -> torch.Tensor:
    """The last layer from its attention on (in `buffers`), for `rows` only: the other rows' results reach
    no logits (their K/V are cached by then), so a prompt's chunk runs that layer's output projection and
    MLP for its last token alone, as llama.cpp does (SmolLM2: a thirtieth of a prompt's output projections
    and MLPs left out). Each row is computed alone in the C layer: a row's bits are what it gets among all."""
    m = rows.numel()
    h = h[rows]
    buffers.attn[:m] = buffers.attn[rows]
    views = (buffers.x, buffers.qkv, buffers.attn, buffers.gate_up, buffers.slots)
    sub = StepBuffers(*(view[:m] for view in views), angles=[angle[:m] for angle in buffers.angles])
    if m:
        c_layers.out(DecoderLayers.step(cfg, sub, kv), cfg.num_layers - 1, h)
    return h


class Rope:
    """Rotate-half RoPE at one base: cos/sin for a step's positions, computed per step (a table over the
    whole window is 64 MB for Gemma's 32k x 256), with HF's arithmetic: each angle is one float32 product
    of a position and an inverse frequency."""

    def __init__(
        self, head_dim: int, theta: float, divisors: torch.Tensor | float, device: torch.device
    ) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.inv_freq = (inv_freq / divisors).to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, head_dim] each, broadcast over heads."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def _narrow_weights(tensors: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.dtype | None:
    """The 16-bit dtype of the 2-D weights kept narrower than the model's `dtype`, None where there are
    none."""
    narrow = {
        t.dtype for t in tensors.values() if t.dim() == 2 and t.dtype in HALF_DTYPES and t.dtype != dtype
    }
    if len(narrow) > 1:
        raise ValueError(f"weights of more than one 16-bit dtype: {sorted(map(str, narrow))}")
    return narrow.pop() if narrow else None


def _storage_counts(
    tensors: dict[str, torch.Tensor], quantized: Mapping[str, QuantizedWeight]
) -> dict[str, int]:
    """Tensors per storage type of weights given in memory: their dtype, or "block" for codes."""
    kinds = [str(t.dtype).removeprefix("torch.").upper() for t in tensors.values()]
    kinds += ["block"] * len(quantized)
    return {kind: kinds.count(kind) for kind in sorted(set(kinds))}


_PROGRESS_REPORTS = 4  # lines while the layers are read and packed: the longest part of a load


def _bind(
    binder: Binder, num_layers: int, progress: Callable[[str], None] | None
) -> tuple[Projection, list[Layer]]:
    """The LM head and every layer, one after another (a layer's codes are freed before the next is read);
    `progress` hears how far it is a few times on the way."""
    start, every = time.perf_counter(), max(1, num_layers // _PROGRESS_REPORTS)
    layers: list[Layer] = []
    for i in range(num_layers):
        layers.append(binder.layer(i))
        if progress is not None and ((i + 1) % every == 0 or i + 1 == num_layers):
            progress(f"{i + 1}/{num_layers} layers read and packed ({time.perf_counter() - start:.1f}s)")
    return binder.lm_head(), layers


class Transformer:
    """The model of one GGUF. `tensors` are the dense tensors under their GGUF names; `quantized` the codes
    of the weights stored in a block format (`GGUFModel.quantized`). Without codes, or with
    `decode_matmul="dense"`, every matmul runs on BLAS over dense weights. `activation_dtype="int8"`: the
    kernel multiplies the codes of every block format by int8-quantized rows
    (csrc/packed_matmul.c's KVF_DOT); other weights, and every weight on the dense path, take float32 rows
    whatever it says. `activation_dtype="bfloat16"`: the 16-bit kernel multiplies bfloat16 weights by rows
    rounded to bfloat16 (half_matmul.py's pairs; ValueError where the weights are not bfloat16 in that
    kernel). "auto" resolves to "int8" where the packed kernel runs, "bfloat16" where the 16-bit kernel
    runs bfloat16 weights on a CPU with AVX512-BF16, "float32" elsewhere (the resolved name is
    `activation_dtype`). With either narrow row the C prefill attention runs its products in bf16 where
    the CPU has AVX512-BF16."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        decode_attention: str = "auto",
        quantized: Mapping[str, QuantizedWeight] | None = None,
        decode_matmul: str = "auto",
        activation_dtype: str = "auto",
        progress: Callable[[str], None] | None = None,
    ) -> None:
        if activation_dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"activation dtype must be one of {ACTIVATION_DTYPES}, not {activation_dtype!r}")
        self.config = config
        # How the weights are stored, as llama.cpp's load log counts them (tensors per type); the loader's
        # `GGUFModel.quantization` when built from a file, else the dtypes of the tensors given.
        self.quantization = _storage_counts(tensors, quantized or {})
        norm = tensors["output_norm.weight"]
        self.device, self.dtype = norm.device, norm.dtype
        quantized = quantized or {}
        # 16-bit weights under a wider model (a Hugging Face directory's BF16 under float32) stay 16-bit.
        self.weight_dtype = _narrow_weights(tensors, self.dtype)
        kernel, self.decode_matmul_note = self._choose_kernel(
            "decode matmul", decode_matmul, DECODE_MATMUL, self._matmul_loader(bool(quantized))
        )
        self._packed_kernel = kernel if isinstance(kernel, PackedMatmulKernel) else None
        self._half_kernel = kernel if isinstance(kernel, HalfMatmulKernel) else None
        activation_dtype = self._activations(activation_dtype)
        self._kernel, self.decode_attention_note = self._choose_kernel(
            "decode attention", decode_attention, DECODE_ATTENTION, self._attention_loader(activation_dtype)
        )
        self.decode_attention = "kernel" if self._kernel else "sdpa"
        half = self._half_kernel is not None
        dot, pairs = activation_dtype == "int8", activation_dtype == "bfloat16"
        binder = Binder(tensors, quantized, self._packed_kernel, dot, half, pairs)
        self.lm_head, self.layers = _bind(binder, config.num_layers, progress)
        packed = [self.lm_head.packed] + [p.packed for layer in self.layers for p in layer.projections()]
        if self._packed_kernel is not None and not any(packed):
            if decode_matmul == "kernel":
                raise ValueError("decode matmul 'kernel' is unavailable: no weight fits its panels")
            self._packed_kernel, self.decode_matmul_note = None, "no weight fits the kernel's panels"
            binder = Binder(tensors, quantized, None, half=half)
            self.lm_head, self.layers = _bind(binder, config.num_layers, progress)
        self.decode_matmul = "kernel" if self._packed_kernel or self._half_kernel else "dense"
        self.activation_dtype = activation_dtype
        self.embed = Embedding(binder, self.lm_head, config.tie_word_embeddings)
        self.norm = tensors["output_norm.weight"]
        self._act = _ACTIVATIONS[config.activation]
        self._attention = [
            LayerAttention(config.attention_scale, config.window(i)) for i in range(config.num_layers)
        ]
        divisors = tensors.get("rope_freqs.weight", 1.0)  # Llama 3's per-frequency RoPE scaling
        self._rope = Rope(
            config.head_dim, config.rope_theta, divisors * config.rope_linear_factor, self.device
        )
        self._local_rope = (
            Rope(config.head_dim, config.local_rope_theta, 1.0, self.device) if config.local_layers else None
        )
        # Every layer's row-wise work in C, where every matmul (over packed codes or 16-bit weights) and the
        # decode attention run in the C kernels (CPU float32): one call per layer around attention, one per
        # step for every layer when all rows decode. Elsewhere, the torch forward below.
        self._c_layers: DecoderLayers | None = None
        matmul_in_c = self._packed_kernel is not None or self._half_kernel is not None
        if matmul_in_c and isinstance(self._kernel, PagedDecodeKernel):
            windows = [spec.window for spec in self._attention]
            self._c_layers, _ = DecoderLayers.build(self.layers, windows, set(config.local_layers))

    @property
    def packed_matmul(self) -> PackedMatmulKernel | None:
        """The decode-row kernel over packed weights, None where decode multiplies dense weights."""
        return self._packed_kernel

    @property
    def half_matmul(self) -> HalfMatmulKernel | None:
        """The decode-row kernel over 16-bit weights under a float32 model, None where there are none."""
        return self._half_kernel

    @classmethod
    def from_gguf(
        cls,
        gguf: GGUFModel,
        decode_attention: str = "auto",
        decode_matmul: str = "auto",
        activation_dtype: str = "auto",
        progress: Callable[[str], None] | None = None,
    ) -> Transformer:
        model = cls(
            gguf.config,
            gguf.tensors,
            decode_attention,
            gguf.quantized,
            decode_matmul,
            activation_dtype,
            progress,
        )
        model.quantization = dict(gguf.quantization)
        return model

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

    def _matmul_loader(
        self, quantized: bool
    ) -> Callable[[], tuple[PackedMatmulKernel | HalfMatmulKernel | None, str]]:
        """The decode-row kernel the weights call for: the packed one over block-format codes, the 16-bit
        one over 16-bit weights under a float32 model, none over weights in the model's own dtype."""
        if quantized:
            return self._on_cpu_float32(packed_matmul.load)
        if self.weight_dtype is not None:
            return self._on_cpu_float32(half_matmul.load)
        return lambda: (None, "the weights are not stored quantized")

    def _activations(self, asked: str) -> str:
        """The activation dtype `asked` resolves to ("auto": the fastest this model's kernels run); bfloat16
        where no 16-bit kernel multiplies bfloat16 weights is refused, never half applied."""
        bf16_kernel = self._half_kernel is not None and self.weight_dtype == torch.bfloat16
        if asked == "bfloat16" and not bf16_kernel:
            weights = self.weight_dtype or self.dtype
            where = "" if self._half_kernel else f" (a {self.dtype} model on {self.device}: no 16-bit kernel)"
            raise ValueError(
                "activation dtype 'bfloat16' multiplies bfloat16 weights kept 16-bit under a float32 model "
                f"on CPU (a Hugging Face directory's); this model's 2-D weights are {weights}{where}"
            )
        if asked != "auto":
            return asked
        if self._packed_kernel is not None:
            return "int8"
        return "bfloat16" if bf16_kernel and half_matmul.pairs_native() else "float32"

    def _attention_loader(self, activation_dtype: str) -> Callable[[], tuple[PagedDecode | None, str]]:
        """The device seam of decode attention: the C kernel on CPU, the Triton kernel on CUDA (the same
        arguments, the same float32-accumulated result, each row alone). The C prefill kernel's bf16
        products (AVX512-BF16) come with narrow activations only: the float32 path stays exact."""
        if self.device.type == "cuda":
            return lambda: triton_attention.load(self.device.type)
        narrow = activation_dtype in ("int8", "bfloat16")
        bf16 = None if narrow else False  # None: paged_kernel's default (its variable)
        return self._on_cpu_float32(lambda: paged_kernel.load(bf16=bf16))

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # In float32 whatever the weights' dtype, as HF does; F.rms_norm is one fused kernel, and in
        # float32 applying the weight inside it is bit-identical to HF's `weight * normed` (checked).
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), weight, eps=self.config.rms_norm_eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, kv: torch.Tensor) -> torch.Tensor:
        """Run one step; `kv` is the pool tensor [layers, 2, pages, page_size, kv_heads, head_dim].
        Returns float32 logits [S, vocab] for `inputs.logits_rows`."""
        return self._linear(self.hidden_states(inputs, kv), self.lm_head).float()

    @torch.inference_mode()
    def hidden_states(self, inputs: StepInputs, kv: torch.Tensor) -> torch.Tensor:
        """`forward` up to the LM head: the hidden states after the final norm [S, hidden_size], in the
        model's dtype, for `inputs.logits_rows` (what the embedding pooler reads). `kv` may be any tensor
        of the pool's layout: the step's K/V are written into its slots as `forward` writes the pool's."""
        cfg = self.config
        h = self.embed(inputs.input_ids)
        if cfg.embedding_scale != 1.0:
            h = h * torch.tensor(cfg.embedding_scale, dtype=h.dtype)
        angles = self._rope.cos_sin(inputs.positions, self.dtype)
        local = self._local_rope.cos_sin(inputs.positions, self.dtype) if self._local_rope else angles
        if self._c_layers is not None:  # the logits rows only
            h = self._layers_in_c(self._c_layers, h.contiguous(), inputs, kv, (*angles, *local))
        else:
            slots = self._decode_slots(inputs, kv.shape[3])
            for li, layer in enumerate(self.layers):
                rope = local if li in cfg.local_layers else angles
                x = self._rms_norm(h, layer.attn_norm)
                attn = self._attend(li, layer, x, inputs, kv, rope, slots)
                out = self._linear(attn, layer.o)
                h = h + (out if layer.post_attn_norm is None else self._rms_norm(out, layer.post_attn_norm))
                gate, up = self._linear(self._rms_norm(h, layer.ffn_norm), layer.gate_up).chunk(2, dim=-1)
                out = self._linear(self._act(gate) * up, layer.down)
                h = h + (out if layer.post_ffn_norm is None else self._rms_norm(out, layer.post_ffn_norm))
            h = h[inputs.logits_rows]
        return self._rms_norm(h, self.norm)

    def _decode_slots(self, inputs: StepInputs, page_size: int) -> torch.Tensor | None:
        """What decode rows over SDPA gather (`attention.context_slots`), made once for every layer of the
        step; None where the kernel decodes, or no row does."""
        if self._kernel is not None or not inputs.decode_rows.numel():
            return None
        if inputs.zero_page is None:
            raise ValueError("decode attention over SDPA needs the pool's zero page")
        tables, lens = inputs.decode_block_tables, inputs.decode_context_lens
        return attention.context_slots(tables, lens, page_size, inputs.zero_page)

    def _layers_in_c(
        self,
        c_layers: DecoderLayers,
        h: torch.Tensor,
        inputs: StepInputs,
        kv: torch.Tensor,
        angles: tuple[torch.Tensor, ...],
    ) -> torch.Tensor:
        """Every layer through the C layer: one call for the step when every row decodes, else per layer
        the C layer around attention here (the paged kernel for decode rows, `_prefill_attention` for
        prefill chunks), the last layer's output projection and MLP for the logits rows only. Returns the
        hidden states of `inputs.logits_rows`."""
        cfg = self.config
        rows, nq, nkv, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        buffers = StepBuffers(
            x=torch.empty(rows, cfg.hidden_size),
            qkv=torch.empty(rows, (nq + 2 * nkv) * hd),
            attn=torch.empty(rows, nq * hd),
            gate_up=torch.empty(rows, 2 * cfg.intermediate_size),
            slots=inputs.slot_mapping.contiguous(),
            angles=[angle.reshape(rows, hd).contiguous() for angle in angles],
        )
        if not inputs.prefills:
            tables, lens = inputs.decode_block_tables.contiguous(), inputs.decode_context_lens.contiguous()
            c_layers.decode(DecoderLayers.step(cfg, buffers, kv, tables, lens), h)
            return h[inputs.logits_rows]
        step, last = DecoderLayers.step(cfg, buffers, kv), cfg.num_layers - 1
        q, k, v = buffers.qkv.view(rows, nq + 2 * nkv, hd).split([nq, nkv, nkv], dim=1)
        attn = buffers.attn.view(rows, nq, hd)
        for li in range(cfg.num_layers):
            c_layers.qkv(step, li, h)
            k_cache, v_cache, spec = kv[li, 0], kv[li, 1], self._attention[li]
            if inputs.decode_rows.numel():
                tables, lens = inputs.decode_block_tables, inputs.decode_context_lens
                rows_q = q[inputs.decode_rows]
                attn[inputs.decode_rows] = attention.decode(
                    self._kernel, rows_q, k_cache, v_cache, tables, lens, spec, None
                )
            for seq in inputs.prefills:
                attn[seq.start : seq.end] = self._prefill_attention(q, k, v, k_cache, v_cache, seq, spec)
            if li < last:
                c_layers.out(step, li, h)
        return _logits_rows_out(c_layers, cfg, buffers, kv, h, inputs.logits_rows)

    def _attend(
        self,
        li: int,
        layer: Layer,
        x: torch.Tensor,
        inputs: StepInputs,
        kv: torch.Tensor,
        angles: tuple[torch.Tensor, torch.Tensor],
        slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """Layer `li`'s attention block up to the output projection: Q/K/V, their norms and RoPE at the
        layer's `angles` (cos, sin), the new K/V stored in their slots, attention over the pool (decode
        rows over SDPA: at `_decode_slots`). Returns [T, heads * head_dim]."""
        cfg = self.config
        nq, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = self._linear(x, layer.qkv).view(-1, nq + 2 * nkv, hd)
        q, k, v = qkv.split([nq, nkv, nkv], dim=1)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        cos, sin = angles
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k_cache, v_cache = kv[li, 0], kv[li, 1]
        k_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, nkv, hd).index_copy_(0, inputs.slot_mapping, v.to(v_cache.dtype))
        spec = self._attention[li]

        def decode(rows: torch.Tensor) -> torch.Tensor:
            tables, lens = inputs.decode_block_tables, inputs.decode_context_lens
            return attention.decode(self._kernel, rows, k_cache, v_cache, tables, lens, spec, slots)

        if not inputs.prefills:  # a pure decode step: every row is a decode row, in order
            return decode(q).view(-1, nq * hd)
        out = torch.empty_like(q)
        if inputs.decode_rows.numel():
            out[inputs.decode_rows] = decode(q[inputs.decode_rows])
        for seq in inputs.prefills:
            out[seq.start : seq.end] = self._prefill_attention(q, k, v, k_cache, v_cache, seq, spec)
        return out.view(-1, nq * hd)

    def _prefill_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq: PrefillSeq,
        spec: LayerAttention,
    ) -> torch.Tensor:
        """A prefill chunk's attention [n, heads, head_dim]: the C kernel over the chunk's pages where it
        runs and the step gave them, else SDPA. The kernel computes each query row from its position and
        the pool alone, so a prompt's logits do not depend on how it is chunked; SDPA's rounding changes
        with the chunk's shape, which int8 activations turned into logits 0.7 apart (SmolLM2, 300 tokens,
        whole against chunks of 64)."""
        if isinstance(self._kernel, PagedDecodeKernel) and seq.pages is not None:
            start = seq.context_len - (seq.end - seq.start)
            rows = q[seq.start : seq.end]
            return self._kernel.prefill(rows, k_cache, v_cache, seq.pages, start, spec.scale, spec.window)
        return attention.prefill(q, k, v, k_cache, v_cache, seq, spec)

    def _linear(self, x: torch.Tensor, weight: Projection) -> torch.Tensor:
        """`x @ weight` (+ bias): every row through the packed kernel where the weight is packed, else BLAS.

        The kernel computes each row alone, so a row's result does not depend on what it is batched with
        (batched == solo, the oracle the fence tests and the audit lean on), prefill rows included. It
        is also the faster path at every row count measured (SmolLM2's layers, two threads of a 2-core
        EPYC): 7 ms at 1 row against 29 ms for BLAS over the weights dequantized on the fly (22 of them
        dequantizing), 94 vs 178 ms at 64 rows, 860 vs 1013 at 512, 3497 vs 3536 at 2048."""
        if self._packed_kernel is not None and weight.packed is not None:
            out = self._packed_kernel(x, weight.packed)
        elif self._half_kernel is not None and weight.half is not None:
            out = self._half_kernel(x if x.stride(-1) == 1 else x.contiguous(), weight.half)
        else:
            assert weight.dense is not None  # 16-bit weights without the 16-bit kernel widen for the call
            out = _matmul(x, weight.dense.to(x.dtype))
        return out if weight.bias is None else out + weight.bias
