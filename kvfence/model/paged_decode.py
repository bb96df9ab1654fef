"""The decode-attention kernel contract: what the model's device seam (`Transformer._attention_loader`)
hands back, whichever device it runs on.

`paged_kernel.PagedDecodeKernel` (C, CPU, float32) and `triton_attention.TritonPagedDecode` (CUDA, or the
Triton interpreter) implement it; where neither can run, the model's torch path (gather + SDPA) computes
the same thing.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedDecode(Protocol):
    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """Attention of one query token per row over that row's pages, read in place in the pool (no
        gathered copy): q [rows, heads, head_dim]; k_cache, v_cache [pages, page_size, kv_heads, head_dim]
        (one layer's view of the pool); block_tables [rows, width], the pages the fence validated;
        context_lens [rows], each row's context (a row's last page may be partly written); q.k is
        multiplied by `scale`; `window` > 0 (a sliding-window layer) attends over the last `window` tokens
        of the context only, and reads no page before them.
        Returns [rows, heads, head_dim], accumulated in float32, each row independent of the others
        (batch invariance). A kernel refuses a page outside the pool before reading anything."""
        ...
