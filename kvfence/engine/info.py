"""What pins a running engine, reported by the server itself at GET /v1/audit/info: the code (version, git
commit), the weights (file, sha256, architecture, tensors per storage type), the pool and the window, whether
the fence is on, speculation (a draft model's file and sha256, and its own pool's pages and fence), and
whether decode is batch-invariant (`batch_invariant`: the audit's replay check fails any
answer that changes under load only where it is true).

An auditor compares these with what it expects; it never has to trust its own copy of the model file or
guess the page size. Everything here is static after start-up, so it is safe to read from any thread.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kvfence.engine.draft_model import DraftModelDrafter
from kvfence.engine.engine import LLMEngine
from kvfence.model.transformer import Transformer
from kvfence.pins import code_info, file_sha256


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """This engine's pins (one pool). The model sha256 is None when the engine was not loaded from a file."""
    path = engine.model_file
    return {
        **code_info(),
        "pid": os.getpid(),
        "model_file": str(path) if path else None,
        "model_sha256": file_sha256(path) if path else None,
        "architecture": engine.model.config.architecture,
        "quantization": engine.model.quantization,  # tensors per storage type: {"Q4_K": 27, "Q6_K": 9, ...}
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.model.device),
        "decode_attention": engine.model.decode_attention,
        "decode_matmul": engine.model.decode_matmul,
        "activation_dtype": engine.model.activation_dtype,
        "kv_cache_dtype": str(engine.pool.kv.dtype).removeprefix("torch."),
        "page_size": engine.pool.page_size,
        "num_pages": engine.pool.num_pages,
        "capacity_tokens": engine.capacity.capacity_tokens,
        "max_model_len": engine.max_model_len,
        "isolation": engine.fence.enabled,
        "prefix_caching": engine.prefix is not None,
        # KV tiers below the pool: each one's kind, spec, bytes held and seal (none: an empty list).
        "kv_tiers": engine.kv_cache.tiers.describe() if engine.kv_cache.tiers is not None else [],
        "speculative": _speculative(engine),
        # Decode rows computed one at a time, in a fixed reduction order, by the C kernels (packed matmul for
        # every projection and the LM head, paged attention): what shares the batch cannot change them.
        # None (no pin) where the operator hid it (--hide-batch-invariance).
        "batch_invariant": _decode_rows_alone(engine.model)
        if engine.config.declare_batch_invariance
        else None,
    }


def _speculative(engine: LLMEngine) -> dict[str, Any] | None:
    """The speculative config; for a draft model also its file and sha256, and its pool (pages, fenced)."""
    spec, drafter = engine.config.speculative, engine.scheduler.drafter
    if spec is None:
        return None
    found: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.model is not None and isinstance(drafter, DraftModelDrafter):
        found |= {
            "draft_model_file": spec.model,
            "draft_model_sha256": file_sha256(Path(spec.model)),
            "draft_pool_pages": drafter.pool.num_pages,
            "draft_pool_fenced": drafter.fence.enabled,
        }
    return found


def _decode_rows_alone(model: Transformer) -> bool:
    """Every decode-row matmul and the attention run in the per-row kernels; False on any BLAS or SDPA
    fallback (`--decode-matmul dense`, `--decode-attention sdpa`, not float32 on CPU, an unpacked weight),
    whose results depend on the number of rows in the step."""
    projections = [model.lm_head, *(p for layer in model.layers for p in layer.projections())]
    kernels = model.decode_matmul == "kernel" and model.decode_attention == "kernel"
    return kernels and all(p.packed is not None for p in projections)
