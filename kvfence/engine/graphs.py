"""Decode steps replayed from captured graphs: batch-size buckets over static input buffers.

Contract. A `DecodeGraphRunner` serves pure decode steps (one new token per row, every row sampled) of
up to `max_num_seqs` rows; `run(batch)` returns the float32 logits of the batch's rows, or None when no
bucket fits (a wider table or more rows: the caller runs the eager forward). Everything else is the
model's own forward, so the numbers are the eager path's for the same padded batch.

- Buckets are 1, 2, 4, 8, ... and `max_num_seqs`; a batch runs in the smallest bucket that holds it.
- Static buffers, allocated once at the largest bucket and viewed per bucket, are the only inputs a
  captured forward reads: token ids, positions, slot mapping and context lengths travel in one packed
  host->device copy per step; a block table row is copied only when it changed (a page was added, or
  another request took the row), against a host mirror, so a steady decode step copies no table at all;
  the row indices are a static range. A capture records addresses, so nothing it reads may be freed.
- Padding rows (bucket minus batch) read and write only the scratch page: a page of the KV tensor beyond
  the pool's `num_pages`, which no allocator hands out (`KVPool(scratch_page=True)`). So a padding row touches
  nothing any request owns, and the fence's guarantee is untouched: the real rows read exactly the pages
  the fence validated, as in the eager path.
- The device seam is `GraphBackend.capture(fn) -> replay`: `CudaGraphBackend` records `fn` into a
  torch.cuda.CUDAGraph; tests inject a fake that records the calls and re-runs `fn` on replay (what a
  graph does, as long as `fn` reads only the static buffers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvfence.cache.fence import StepLayout
from kvfence.cache.pool import KVPool
from kvfence.model.transformer import StepInputs, Transformer

Replay = Callable[[], torch.Tensor]


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below `max_num_seqs`, then `max_num_seqs` itself: at most half a bucket padded."""
    buckets = [1 << i for i in range(max_num_seqs.bit_length()) if 1 << i < max_num_seqs]
    return [*buckets, max_num_seqs]


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding `rows`, None when none does."""
    return next((b for b in buckets if b >= rows), None)


@dataclass
class DecodeBatch:
    """A pure decode step on the host, one new token per row, in the fence's StepLayout terms."""

    token_ids: np.ndarray  # [rows] the token each row feeds
    positions: np.ndarray  # [rows] its position (= tokens before it)
    slots: np.ndarray  # [rows] flat slot (page * page_size + offset) its K/V is written to
    pages: np.ndarray  # row r reads pages[starts[r]:starts[r + 1]] (the fence-validated mapping)
    starts: np.ndarray  # [rows + 1]

    @classmethod
    def from_layout(cls, layout: StepLayout, token_ids: np.ndarray, page_size: int) -> DecodeBatch:
        """A validated decode layout (one write per row) and the token each row feeds."""
        assert layout.write_rows.size == layout.starts.size - 1, "one new token per row"
        slots = layout.write_pages * page_size + layout.write_offsets
        return cls(token_ids, layout.write_positions, slots, layout.pages, layout.starts)

    @property
    def rows(self) -> int:
        return len(self.token_ids)

    def padded_tables(self, width: int, fill: int) -> np.ndarray:
        """[rows, width]: each row's pages, then `fill` (vectorised: no loop over rows)."""
        counts = np.diff(self.starts)
        rows = np.repeat(np.arange(self.rows), counts)
        tables = np.full((self.rows, width), fill, dtype=np.int64)
        tables[rows, np.arange(self.pages.size) - self.starts[rows]] = self.pages
        return tables


class GraphBackend(Protocol):
    def capture(self, fn: Replay) -> Replay:
        """Record `fn` (it reads only static buffers) and return what replays it, yielding its output."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture: `fn` is warmed up on a side stream (lazy initialisation, Triton's
    compilation) then captured; the graphs share one memory pool, as only one replays at a time."""

    def __init__(self) -> None:
        self._pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Replay) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        return CapturedGraph(graph, out, fn)


@dataclass(frozen=True)
class CapturedGraph:
    """A captured graph, its output buffer, and the function it was captured from. `fn` is held for the
    graph's life: a replay reads the addresses of whatever `fn` closed over, and a tensor freed after the
    capture goes to the next allocation, whose bytes every later replay would read (found on an H200: the
    first replay right, the next ones gathering out of bounds)."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    fn: Replay

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


class DecodeGraphRunner:
    """Captured decode forwards, one per bucket, over one set of static buffers (see the module doc)."""

    def __init__(
        self,
        model: Transformer,
        pool: KVPool,
        max_num_seqs: int,
        max_pages_per_seq: int,
        backend: GraphBackend,
    ) -> None:
        self.model, self.pool, self.backend = model, pool, backend
        if pool.scratch_page is None:
            raise ValueError(
                "captured decode pads into a scratch page: build the pool with scratch_page=True"
            )
        self.scratch_page = pool.scratch_page
        self.buckets = batch_buckets(max_num_seqs)
        size, device = self.buckets[-1], model.device
        self.width = max_pages_per_seq
        # ids, positions, slots, lens: one packed buffer, so a step's small inputs are one copy.
        self.rows = torch.arange(size, device=device)  # decode rows and logits rows: static like the rest
        self.packed_host = torch.zeros(4, size, dtype=torch.long)
        self.packed = torch.zeros(4, size, dtype=torch.long, device=device)
        self.tables_host = np.full((size, self.width), self.scratch_page, dtype=np.int64)
        # A copy even on CPU (`.to("cpu")` would alias the mirror, and a missing device copy would go unseen).
        self.tables = torch.from_numpy(self.tables_host).to(device, copy=True)
        self.table_rows_copied = 0  # block-table rows sent to the device in the last step
        self._graphs: dict[int, Replay] = {}

    def run(self, batch: DecodeBatch) -> torch.Tensor | None:
        """Logits [rows, vocab] for `batch`, or None when it fits no bucket (run it eagerly). The logits
        are a view of the graph's output buffer: read them before the next `run`."""
        bucket = bucket_for(batch.rows, self.buckets)
        if bucket is None or np.diff(batch.starts).max(initial=0) > self.width:
            return None
        self._load(batch, bucket)
        replay = self._graphs.get(bucket)
        if replay is None:
            replay = self._graphs[bucket] = self.backend.capture(self._forward(bucket))
        return replay()[: batch.rows]

    def _forward(self, bucket: int) -> Replay:
        """The eager forward over the first `bucket` rows of the static buffers (what gets captured)."""
        inputs = self.static_inputs(bucket)
        return lambda: self.model.forward(inputs, self.pool.kv)

    def static_inputs(self, bucket: int) -> StepInputs:
        """The forward's inputs for `bucket` rows: views of the static buffers alone, so a replay reads
        this step's values at the addresses the capture recorded."""
        ids, positions, slots, lens = self.packed[:, :bucket]
        rows = self.rows[:bucket]
        return StepInputs(
            input_ids=ids,
            positions=positions,
            slot_mapping=slots,
            decode_rows=rows,
            decode_block_tables=self.tables[:bucket],
            decode_context_lens=lens,
            prefills=[],
            logits_rows=rows,
            zero_page=self.pool.zero_page,
        )

    def _load(self, batch: DecodeBatch, bucket: int) -> None:
        """Copy the step's inputs into the static buffers; rows from `batch.rows` to `bucket` are padding."""
        n, scratch_slot = batch.rows, self.scratch_page * self.pool.page_size
        packed = self.packed_host[:, :bucket].numpy()
        packed[:, n:] = np.array([[0], [0], [scratch_slot], [1]])  # token 0 at 0, in the scratch page
        packed[0, :n], packed[1, :n], packed[2, :n] = batch.token_ids, batch.positions, batch.slots
        packed[3, :n] = batch.positions + 1  # a decode row attends over every token up to its own
        self.packed[:, :bucket].copy_(self.packed_host[:, :bucket])
        self._load_tables(batch, bucket)

    def _load_tables(self, batch: DecodeBatch, bucket: int) -> None:
        """Only the rows that changed go to the device. Past its pages a row names the scratch page, so its
        table names no other request's page (the SDPA fallback reads the pool's zero page past a row's
        context, whatever the table holds there)."""
        new = np.full((bucket, self.width), self.scratch_page, dtype=np.int64)
        new[: batch.rows] = batch.padded_tables(self.width, self.scratch_page)
        changed = np.flatnonzero((self.tables_host[:bucket] != new).any(axis=1))
        self.table_rows_copied = changed.size
        if changed.size:
            self.tables_host[changed] = new[changed]
            device = self.tables.device
            rows = torch.from_numpy(changed).to(device)
            self.tables.index_copy_(0, rows, torch.from_numpy(new[changed]).to(device))
