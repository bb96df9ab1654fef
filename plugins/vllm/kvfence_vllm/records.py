"""The scheduler side: an expected-mapping record per request, and the plan each step ships to the worker.

After vLLM's scheduler has allocated a step's blocks, `SchedulerRecords.plan` brings every scheduled
request's MappingRecord (kvfence's, one row of a shared BlockTable) up to the block ids vLLM's KV cache
manager holds for it: new blocks are appended at their current generation and claimed for the request's
tenant. It then judges all records at once with kvfence's read check against the block tags (stale
generation: a block freed or reused under the request; foreign owner: a block another tenant's KV fills,
or one nobody holds) and returns a `StepPlan`: the records flattened for the worker, and the requests
already condemned. A record is forgotten when vLLM frees the request's blocks (finish, abort, preemption).

Each record has a written length, kept apart from vLLM's num_computed_tokens: the tokens whose KV steps
that ran wrote for the request. A new record starts at its leading blocks whose every slot is written (a
prefix hit: blocks a step that ran filled, or an earlier request of the same step fills, up to the first
block that is not; after a preemption this is the request's own cached blocks, or nothing). `commit`, once
a step ran, advances it by the tokens the step scheduled for the request, less the draft tokens vLLM
rejected (it rolls its own count back by as many), and raises the tags' per-block written counts to match;
a request the step aborted is not advanced. The plan carries each request's written length and scheduled
tokens for the worker's start check (rows.py).

A hit on a block an earlier request of the same step fills depends on that request's step: were it
condemned, its row would be pointed at the null block and the block never written. So the plan keeps,
per request, the requests of the step whose fills its written length counts, and `StepPlan.spread`
condemns, with UNWRITTEN_READ, every request that counts a fill of a condemned one (transitively); the
scheduler's verdict and the worker's both go through it.

Not judged here: a change of an entry already recorded: when vLLM replaces a block it handed out earlier
(copy-on-write, a sliding window's null block), the record is rebuilt from vLLM's list and counted in
`rebuilt` (its written length is kept).
"""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvfence.cache.block_table import BlockTable
from kvfence.cache.mapping import MappingRecord, StepLayout, check_reads
from kvfence.trail.reasons import UNWRITTEN_READ
from kvfence_vllm.stats import FenceStats
from kvfence_vllm.tags import BlockTags


@dataclass(frozen=True)
class StepPlan:
    """What the worker needs to validate one step: request `req_ids[i]` must run on exactly the blocks
    `pages[starts[i]:starts[i+1]]` (of `block_size` tokens each), starting at token `written[i]` (its record's
    written length) and running `scheduled[i]` tokens. `condemned` (request id -> reason) are aborted
    whatever their rows say. `fillers` (request id -> earlier requests of the step): whose writes in this
    step a request's written length counts."""

    req_ids: tuple[str, ...]
    starts: np.ndarray
    pages: np.ndarray
    written: np.ndarray
    scheduled: np.ndarray
    block_size: int
    condemned: dict[str, str] = field(default_factory=dict)
    fillers: dict[str, frozenset[str]] = field(default_factory=dict)

    def spread(self, verdict: Mapping[str, str]) -> dict[str, str]:
        """`verdict`, and UNWRITTEN_READ for every request counting a block a condemned request of the step
        was to fill (a filler comes earlier in the step, so one pass in order reaches every dependant)."""
        spread = dict(verdict)
        if not spread or not self.fillers:  # most steps: nothing to spread, or no same-step hit
            return spread
        for req_id in self.req_ids:
            fillers = self.fillers.get(req_id)
            if fillers is not None and req_id not in spread and not fillers.isdisjoint(spread):
                spread[req_id] = UNWRITTEN_READ
        return spread


class SchedulerRecords:
    def __init__(self, tags: BlockTags, block_size: int) -> None:
        self.tags = tags
        self.block_size = block_size
        self.table = BlockTable()
        self.records: dict[str, MappingRecord] = {}
        self.written: dict[str, int] = {}  # request id -> its record's written length, in tokens
        self.in_flight: dict[int, StepPlan] = {}  # id(SchedulerOutput) -> its plan, until the step ran
        self._tenants: dict[str, int] = {}
        self.rebuilt = 0
        self.stats = FenceStats()  # kept here, beside the records, by the scheduler hooks (patches.py)

    def tenant_id(self, name: str) -> int:
        """A small integer per tenant name (a request's cache_salt; '' for none), stable for the process."""
        return self._tenants.setdefault(name, len(self._tenants))

    def sync(
        self, req_id: str, tenant: str, block_ids: Sequence[int], filling: Mapping[int, str] | None = None
    ) -> tuple[MappingRecord, frozenset[str]]:
        """The request's record, brought up to `block_ids` (vLLM's list for it, in logical order), and the
        requests whose fills its written length counts: a new record's written length is its prefix hit
        (`filling`: block -> the earlier request of the step that fills it)."""
        record, fillers = self.records.get(req_id), frozenset()
        ids = np.asarray(block_ids, dtype=np.int64)
        if record is None:
            record = self.records[req_id] = MappingRecord(self.tenant_id(tenant), table=self.table)
            self.written[req_id], fillers = self._full_prefix(ids, filling or {})
        held = len(record)
        if held > ids.size or not np.array_equal(self.table.pages[record.row, :held], ids[:held]):
            record.clear()
            held, self.rebuilt = 0, self.rebuilt + 1
        fresh = ids[held:]
        if fresh.size:
            self.tags.claim(fresh, record.tenant)
            for block, generation in zip(fresh.tolist(), self.tags.generation[fresh].tolist(), strict=True):
                record.append(block, generation)
        return record, fillers

    def _full_prefix(self, ids: np.ndarray, filling: Mapping[int, str]) -> tuple[int, frozenset[str]]:
        """Tokens in the leading blocks of `ids` whose every slot is written (by a step that ran, or by the
        request `filling` names in this one), up to the first that is not; and those requests."""
        full, written, fillers = 0, self.tags.written, set()
        for block in ids.tolist():
            if not 0 <= block < written.size:
                break
            if written[block] < self.block_size:
                if block not in filling:
                    break
                fillers.add(filling[block])
            full += 1
        return full * self.block_size, frozenset(fillers)

    def forget(self, req_id: str) -> None:
        self.written.pop(req_id, None)
        record = self.records.pop(req_id, None)
        if record is not None:
            record.clear()

    def plan(self, scheduled: Sequence[tuple[str, str, Sequence[int], int]]) -> StepPlan:
        """Sync each scheduled (request id, tenant, block ids, tokens scheduled) and judge the records in
        one check."""
        records, filling, fillers = [], {}, {}  # filling: block this step writes to its last slot -> by whom
        for req_id, tenant, ids, count in scheduled:
            record, fillers[req_id] = self.sync(req_id, tenant, ids, filling)
            records.append(record)
            self._note_filled(req_id, record, self.written[req_id], count, filling)
        req_ids = tuple(req_id for req_id, _, _, _ in scheduled)
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
        plan = StepPlan(
            req_ids,
            starts,
            pages,
            np.array([self.written[req_id] for req_id in req_ids], dtype=np.int64),
            np.array([count for _, _, _, count in scheduled], dtype=np.int64),
            self.block_size,
            fillers={req_id: named for req_id, named in fillers.items() if named},
        )
        return replace(plan, condemned=plan.spread({req_ids[row]: reason for row, reason in verdict.items()}))

    def _note_filled(
        self, req_id: str, record: MappingRecord, start: int, count: int, filling: dict[int, str]
    ) -> None:
        size = self.block_size
        for logical in range(start // size, min((start + count) // size, len(record))):
            filling.setdefault(int(self.table.pages[record.row, logical]), req_id)

    def commit(self, plan: StepPlan, rejected: Mapping[str, int], aborted: Container[str]) -> None:
        """`plan`'s step ran: each request it did not abort has its scheduled tokens written, less its
        `rejected` draft tokens; the blocks those tokens fill have their written counts raised."""
        size, written = self.block_size, self.tags.written
        for req_id, count in zip(plan.req_ids, plan.scheduled.tolist(), strict=True):
            record = self.records.get(req_id)
            if record is None or req_id in aborted:
                continue
            start = self.written[req_id]
            end = start + count - rejected.get(req_id, 0)
            first, last = start // size, min(-(-end // size), len(record))
            if first < last:
                blocks = self.table.pages[record.row, first:last]
                filled = np.clip(end - np.arange(first, last) * size, 0, size)
                written[blocks] = np.maximum(written[blocks], filled)
            self.written[req_id] = end
