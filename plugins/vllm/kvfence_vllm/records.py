"""The scheduler side: an expected-mapping record per request, and the plan each step ships to the worker.

After vLLM's scheduler has allocated a step's blocks, `SchedulerRecords.plan` brings every scheduled
request's MappingRecord (kvfence's, one row of a shared BlockTable) up to the block ids vLLM's KV cache
manager holds for it: new blocks are appended at their current generation and claimed for the request's
tenant. It then judges all records at once with kvfence's read check against the block tags (stale
generation: a block freed or reused under the request; foreign owner: a block another tenant's KV fills,
or one nobody holds) and returns a `StepPlan`: the records flattened for the worker, and the requests
already condemned. A record is forgotten when vLLM frees the request's blocks (finish, abort, preemption).

Not judged here: how far a block is written (vLLM keeps no per-block write counts), and a change of an
entry already recorded: when vLLM replaces a block it handed out earlier (copy-on-write, a sliding window's
null block), the record is rebuilt from vLLM's list and counted in `rebuilt`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvfence.cache.block_table import BlockTable
from kvfence.cache.mapping import MappingRecord, StepLayout, check_reads
from kvfence_vllm.stats import FenceStats
from kvfence_vllm.tags import BlockTags


@dataclass(frozen=True)
class StepPlan:
    """What the worker needs to validate one step: request `req_ids[i]` must run on exactly the blocks
    `pages[starts[i]:starts[i+1]]`. `condemned` (request id -> reason) are aborted whatever their rows say."""

    req_ids: tuple[str, ...]
    starts: np.ndarray
    pages: np.ndarray
    condemned: dict[str, str] = field(default_factory=dict)


class SchedulerRecords:
    def __init__(self, tags: BlockTags, block_size: int) -> None:
        self.tags = tags
        self.block_size = block_size
        self.table = BlockTable()
        self.records: dict[str, MappingRecord] = {}
        self._tenants: dict[str, int] = {}
        self.rebuilt = 0
        self.stats = FenceStats()  # kept here, beside the records, by the scheduler hooks (patches.py)

    def tenant_id(self, name: str) -> int:
        """A small integer per tenant name (a request's cache_salt; '' for none), stable for the process."""
        return self._tenants.setdefault(name, len(self._tenants))

    def sync(self, req_id: str, tenant: str, block_ids: Sequence[int]) -> MappingRecord:
        """The request's record, brought up to `block_ids` (vLLM's list for it, in logical order)."""
        record = self.records.get(req_id)
        if record is None:
            record = self.records[req_id] = MappingRecord(self.tenant_id(tenant), table=self.table)
        held = len(record)
        ids = np.asarray(block_ids, dtype=np.int64)
        if held > ids.size or not np.array_equal(self.table.pages[record.row, :held], ids[:held]):
            record.clear()
            held, self.rebuilt = 0, self.rebuilt + 1
        fresh = ids[held:]
        if fresh.size:
            self.tags.claim(fresh, record.tenant)
            for block, generation in zip(fresh.tolist(), self.tags.generation[fresh].tolist(), strict=True):
                record.append(block, generation)
        return record

    def forget(self, req_id: str) -> None:
        record = self.records.pop(req_id, None)
        if record is not None:
            record.clear()

    def plan(self, scheduled: Sequence[tuple[str, str, Sequence[int]]]) -> StepPlan:
        """Sync each scheduled (request id, tenant, block ids) and judge the records in one check."""
        records = [self.sync(req_id, tenant, ids) for req_id, tenant, ids in scheduled]
        req_ids = tuple(req_id for req_id, _, _ in scheduled)
        counts = np.array([len(r) for r in records], dtype=np.int64)
        rows = np.array([r.row for r in records], dtype=np.int64)
        held = counts > 0
        pages, generations = self.table.gather(rows[held], counts[held])
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        no_writes = np.zeros(0, dtype=np.int64)
        layout = StepLayout.of(
            tenants=np.array([r.tenant for r in records], dtype=np.int64),
            num_cached=np.zeros(len(records), dtype=np.int64),
            starts=starts,
            pages=pages,
            generations=generations,
            write_rows=no_writes,
            write_pages=no_writes,
            write_generations=no_writes,
            write_offsets=no_writes,
            write_positions=no_writes,
        )
        tags = self.tags
        verdict = check_reads(layout, tags.generation, tags.owner, tags.state, None, self.block_size)
        return StepPlan(req_ids, starts, pages, {req_ids[row]: reason for row, reason in verdict.items()})
