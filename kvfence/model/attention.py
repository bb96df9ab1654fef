"""Attention of one layer of one step over the paged pool: decode rows through a `PagedDecode` kernel (in
place) or gathered slots and SDPA, prefill chunks through SDPA; every path honours the layer's scale and
sliding window. The pool may hold K/V in a narrower type (float16) than the queries (float32): what is
read from it is widened, and a chunk's own new K/V are rounded as the pool stores them.

Contract: the pages read are the ones in the step's block tables, which the fence validated; a
sliding-window layer reads a subset of them (its last `window` positions), never a page outside them. A
decode row reads no slot past its context: where the torch path needs one (to pad a row to the widest),
it reads the pool's zero page, which no request owns.
Query i of a chunk at position p sees keys at positions j with j <= p and, in a window, p - j < window.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvfence.model.paged_decode import PagedDecode

QUERY_BLOCK = 64  # queries of a causal prefill chunk per SDPA call (`_causal_blocks`)


@dataclass(frozen=True)
class LayerAttention:
    """What differs between layers: q.k's `scale` and the `window` (0: the whole context)."""

    scale: float
    window: int


@dataclass
class PrefillSeq:
    """A prefill chunk: tokens [start, end) of the step, attending over `context_len` cached+new tokens.

    `block_table` is None when the chunk is the whole context (nothing cached): K/V then come straight
    from the step and attention is plainly causal."""

    start: int
    end: int
    context_len: int
    block_table: torch.Tensor | None


def gather_pages(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """The pages named by `block_tables` [..., n] as [..., n * page_size, kv_heads, head_dim].

    index_select over whole flattened pages copies one contiguous run per page: ~3.5x faster than
    advanced indexing `cache[block_tables]`, which walks the trailing dims element by element."""
    ps, nkv, hd = cache.shape[1:]
    pages = cache.view(cache.shape[0], -1).index_select(0, block_tables.flatten())
    return pages.view(*block_tables.shape[:-1], block_tables.shape[-1] * ps, nkv, hd)


def as_stored(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """`x` as it reads back from `cache` (rounded to the pool's float16, if it is that), in x's dtype: a
    chunk attending over its own new K/V sees what every later read of its pages will."""
    return x if cache.dtype == x.dtype else x.to(cache.dtype).to(x.dtype)


@functools.lru_cache(maxsize=2)
def _staircase(rows: int, width: int, device: torch.device) -> torch.Tensor:
    """[rows, width] float32: 0 where j <= width - rows + i, else -inf; its last rows and last columns are
    any block of a prompt's queries' causal bias over the keys it sees (`_causal_blocks`). Made once for a
    prompt's layers, as `_chunk_bias`, and linear in its length (rows fixed)."""
    hidden = (
        torch.arange(width, device=device)[None, :]
        > torch.arange(width - rows, width, device=device)[:, None]
    )
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))


@functools.lru_cache(maxsize=2)
def _chunk_bias(begin: int, ctx: int, n_new: int, window: int, device: torch.device) -> torch.Tensor:
    """[n_new, ctx - begin] float32: 0 where key position j in [begin, ctx) is visible from query position
    p in [ctx - n_new, ctx) (j <= p, and p - j < window in a window), else -inf.

    What SDPA turns a bool mask into, made once for a chunk's layers instead of per layer: the compare and
    that conversion took 9% of a profiled 6,000-token prefill. Kept: the last two (a global and a local layer
    alternate in Gemma); read-only to SDPA."""
    queries = torch.arange(ctx - n_new, ctx, device=device)[:, None]
    keys = torch.arange(begin, ctx, device=device)[None, :]
    hidden = keys > queries
    if window:
        hidden |= queries - keys >= window
    return torch.zeros(hidden.shape, device=device).masked_fill_(hidden, float("-inf"))


def _first_page(start: int, window: int, page_size: int) -> int:
    """The first page a chunk whose first query is at position `start` sees: 0 without a window, else the
    page of `start - window + 1`, the earliest key the first query's window holds."""
    return max(0, start - window + 1) // page_size if window else 0


def decode(
    kernel: PagedDecode | None,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    spec: LayerAttention,
    slots: torch.Tensor | None,
) -> torch.Tensor:
    """q [D, heads, hd] attends over each row's pages: in place with the kernel, else each row's `slots`
    gathered (`context_slots`, made once for a step's layers: the zero page past a row's context) and SDPA
    with the slots past the context, and the positions before a window, masked."""
    if kernel is not None:
        return kernel(q, k_cache, v_cache, block_tables, context_lens, spec.scale, spec.window)
    assert slots is not None, "decode attention over SDPA gathers the step's context_slots"
    keys = gather_slots(k_cache, slots).to(q.dtype).transpose(1, 2)
    values = gather_slots(v_cache, slots).to(q.dtype).transpose(1, 2)
    positions = torch.arange(keys.shape[2], device=q.device)
    last = (context_lens - 1)[:, None]
    mask = positions[None, :] <= last
    if spec.window:
        mask &= last - positions[None, :] < spec.window
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :], enable_gqa=True, scale=spec.scale
    )
    return out.squeeze(2)


def context_slots(
    block_tables: torch.Tensor, context_lens: torch.Tensor, page_size: int, zero_page: int
) -> torch.Tensor:
    """[rows, width * page_size] flat slots (page * page_size + offset): each row's context in order, and
    past it the zero page's first slot. So a gather reads neither a table's padding (another request's
    page, if padded with one) nor the unwritten slots of the row's last page (a previous owner's KV): the
    mask keeps a slot from being attended, not its NaN from poisoning the row (0 * NaN is NaN)."""
    offsets = torch.arange(page_size, device=block_tables.device)
    slots = (block_tables[:, :, None] * page_size + offsets).flatten(1)
    positions = torch.arange(slots.shape[1], device=block_tables.device)
    return torch.where(positions < context_lens[:, None], slots, zero_page * page_size)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """`cache` [pages, page_size, kv_heads, head_dim] at flat `slots` [rows, n]: [rows, n, kv_heads,
    head_dim], one index_select over contiguous slots."""
    nkv, hd = cache.shape[2:]
    return cache.view(-1, nkv * hd).index_select(0, slots.flatten()).view(*slots.shape, nkv, hd)


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq: PrefillSeq,
    spec: LayerAttention,
) -> torch.Tensor:
    """One chunk's queries over its context: the step's own K/V when nothing was cached (without a window,
    in blocks of queries: `_causal_blocks`), else its pages."""
    # SDPA gets a batch dim of 1: on CPU only 4-D inputs reach the fused flash kernel (~3x faster for
    # a 512-token chunk than the 3-D fallback, which materialises the score matrix).
    qs = q[seq.start : seq.end].transpose(0, 1).unsqueeze(0)
    n_new, ctx = seq.end - seq.start, seq.context_len
    if seq.block_table is None:  # the values as the pool holds them: a later chunk reads them from there
        keys, values = as_stored(k[seq.start : seq.end], k_cache), as_stored(v[seq.start : seq.end], v_cache)
    else:  # from the first page a query of the chunk sees: a window's earlier pages are neither read nor
        # attended (over an 8,000-token context, 512-position windows read 1/8 of it)
        page_size = k_cache.shape[1]
        first = _first_page(ctx - n_new, spec.window, page_size)
        table = seq.block_table[first : -(-ctx // page_size)]  # nor a page past the context
        begin = first * page_size
        keys = gather_pages(k_cache, table)[: ctx - begin].to(q.dtype)
        values = gather_pages(v_cache, table)[: ctx - begin].to(q.dtype)
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    if seq.block_table is None and not spec.window:
        return _causal_blocks(qs, keys, values, spec.scale)[0].transpose(0, 1)
    bias = _chunk_bias(ctx - keys.shape[2], ctx, n_new, spec.window, q.device)
    out = F.scaled_dot_product_attention(qs, keys, values, attn_mask=bias, enable_gqa=True, scale=spec.scale)
    return out[0].transpose(0, 1)


def _causal_blocks(qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a whole prompt [1, heads or kv_heads, n, hd], QUERY_BLOCK queries at a time over
    the keys up to the block's last query.

    Why: one causal SDPA call over a 512-token prompt costs what the whole square does on CPU (SmolLM2's 9
    heads, one thread: 9.4 ms causal, 9.4 not); blocks of queries skip the keys none of theirs sees
    (6.1 ms: at 64 a block, 36/64 of the square multiplied; 2,048 tokens 75.7 -> 70.7 ms). Not for a chunk
    over cached pages: there the keys before the chunk are most of the work and SDPA does them faster in one
    call (256 queries over 6,000 keys: 49 ms, in blocks 70)."""
    n = qs.shape[2]
    steps = _staircase(QUERY_BLOCK, n, qs.device)
    out = torch.empty(qs.shape, dtype=qs.dtype, device=qs.device)
    for start in range(0, n, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, n)
        mask = steps[QUERY_BLOCK - (end - start) :, n - end :]  # query start + i sees keys 0..start + i
        out[:, :, start:end] = F.scaled_dot_product_attention(
            qs[:, :, start:end],
            keys[:, :, :end],
            values[:, :, :end],
            attn_mask=mask,
            enable_gqa=True,
            scale=scale,
        )
    return out
