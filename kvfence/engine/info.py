"""What pins a running engine, reported by the server itself at GET /v1/audit/info: the code (version,
git commit), the weights (file and sha256), the pool and the window, and whether the fence is on.

An auditor compares these with what it expects; it never has to trust its own copy of the model file or
guess the page size. Everything here is static after start-up, so it is safe to read from any thread.
"""

from __future__ import annotations

import os
from typing import Any

from kvfence.engine.engine import LLMEngine
from kvfence.pins import code_info, file_sha256


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """This engine's pins (one pool). The model sha256 is None when the engine was not loaded from a file."""
    path = engine.model_file
    return {
        **code_info(),
        "pid": os.getpid(),
        "model_file": str(path) if path else None,
        "model_sha256": file_sha256(path) if path else None,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.model.device),
        "decode_attention": engine.model.decode_attention,
        "decode_matmul": engine.model.decode_matmul,
        "page_size": engine.pool.page_size,
        "num_pages": engine.pool.num_pages,
        "capacity_tokens": engine.capacity.capacity_tokens,
        "max_model_len": engine.max_model_len,
        "isolation": engine.fence.enabled,
        "prefix_caching": engine.prefix is not None,
    }
