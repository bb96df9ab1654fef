"""One model step for a batch: build the step layout, validate it through the fence, run the model.

Order matters and is the point of this file: the fence sees the exact pages the step will read and write
*before* any of them is touched; rows it rejects are dropped and the layout is rebuilt without them, so
attention never runs over a page the fence did not clear.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvfence.cache.fence import Fence, StepLayout
from kvfence.cache.pool import KVPool
from kvfence.model.llama import LlamaModel, PrefillSeq, StepInputs
from kvfence.request import Request
from kvfence.sampling import sample
from kvfence.trail.faults import FaultInjector
from kvfence.units import cdiv

NON_FINITE_LOGITS = "non_finite_logits"  # the model produced NaN/inf for this row: abort it, not the batch

# Called with the rows about to run and their layout, after validation and before the model reads
# anything: tests and the lab use it to trace which pages each request really reads and writes.
StepObserver = Callable[[list[Request], StepLayout], None]
# Called with the sampled requests and their float32 logits [rows, vocab]: golden tests compare them.
LogitsObserver = Callable[[list[Request], torch.Tensor], None]


@dataclass
class StepResult:
    sampled: dict[str, int]  # request id -> new token, for rows that reached the end of their tokens
    aborted: dict[str, str]  # request id -> fence violation, or NON_FINITE_LOGITS


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, fence: Fence, faults: FaultInjector) -> None:
        self.model = model
        self.pool = pool
        self.fence = fence
        self.faults = faults
        self.observer: StepObserver | None = None
        self.logits_observer: LogitsObserver | None = None

    def execute(self, requests: list[Request], num_new: list[int]) -> StepResult:
        layout = build_layout(requests, num_new, self.pool.page_size)
        if self.faults.fire("stale_write") and (page := _redirect_a_write(layout)) is not None:
            self.faults.record("stale_write", request_id=requests[0].request_id, page=page)
        verdict = self.fence.validate_step(layout)
        aborted = {requests[row].request_id: reason for row, reason in verdict.items()}
        if verdict:
            keep = [row for row in range(len(requests)) if row not in verdict]
            requests, num_new = [requests[r] for r in keep], [num_new[r] for r in keep]
            layout = build_layout(requests, num_new, self.pool.page_size)
        if not requests:
            return StepResult({}, aborted)
        if self.observer is not None:
            self.observer(requests, layout)
        inputs, sample_rows = self._model_inputs(requests, num_new, layout)
        logits = self.model.forward(inputs, self.pool.kv)
        self.pool.commit_writes(layout.write_pages, layout.write_offsets)
        sampled_requests = [requests[r] for r in sample_rows]
        if self.logits_observer is not None:
            self.logits_observer(sampled_requests, logits)
        tokens = sample(logits, [r.params for r in sampled_requests], [r.generator for r in sampled_requests])
        sampled = {}
        for request, token in zip(sampled_requests, tokens, strict=True):
            if token is None:
                aborted[request.request_id] = NON_FINITE_LOGITS
            else:
                sampled[request.request_id] = token
        return StepResult(sampled, aborted)

    def _model_inputs(
        self, requests: list[Request], num_new: list[int], layout: StepLayout
    ) -> tuple[StepInputs, list[int]]:
        device, ps = self.model.device, self.pool.page_size
        token_starts = np.concatenate([[0], np.cumsum(num_new)])
        input_ids = list(
            chain.from_iterable(
                r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
                for r, n in zip(requests, num_new, strict=True)
            )
        )
        decode, prefills, logits_rows, sample_rows = [], [], [], []
        for row, (req, n) in enumerate(zip(requests, num_new, strict=True)):
            start, end = int(token_starts[row]), int(token_starts[row + 1])
            context = req.num_computed_tokens + n
            pages = torch.from_numpy(layout.pages[layout.starts[row] : layout.starts[row + 1]])
            if n == 1 and req.num_computed_tokens > 0:
                decode.append((start, context, pages))
            else:
                table = pages.to(device) if req.num_computed_tokens else None
                prefills.append(PrefillSeq(start, end, context, table))
            if context == req.num_tokens and not req.prefill_only:
                logits_rows.append(end - 1)
                sample_rows.append(row)
        max_pages = max((len(p) for _, _, p in decode), default=0)
        tables = torch.zeros(len(decode), max_pages, dtype=torch.long)
        for i, (_, _, pages) in enumerate(decode):
            tables[i, : len(pages)] = pages
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(layout.write_positions).to(device),
            slot_mapping=torch.from_numpy(layout.write_pages * ps + layout.write_offsets).to(device),
            decode_rows=torch.tensor([d[0] for d in decode], dtype=torch.long, device=device),
            decode_block_tables=tables.to(device),
            decode_context_lens=torch.tensor([d[1] for d in decode], dtype=torch.long, device=device),
            prefills=prefills,
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
        )
        return inputs, sample_rows


def build_layout(requests: list[Request], num_new: list[int], page_size: int) -> StepLayout:
    """Flatten the batch's records: the pages each row reads/writes this step and every new token's slot."""
    cached = np.array([r.num_computed_tokens for r in requests], dtype=np.int64)
    new = np.array(num_new, dtype=np.int64)
    mapped = cdiv(cached + new, page_size)  # pages covering every token the step touches
    starts = np.concatenate([[0], np.cumsum(mapped)]).astype(np.int64)
    pages = np.fromiter(
        chain.from_iterable(r.record.pages[:m] for r, m in zip(requests, mapped.tolist(), strict=True)),
        dtype=np.int64,
        count=int(starts[-1]),
    )
    generations = np.fromiter(
        chain.from_iterable(r.record.generations[:m] for r, m in zip(requests, mapped.tolist(), strict=True)),
        dtype=np.int64,
        count=int(starts[-1]),
    )
    write_rows = np.repeat(np.arange(len(requests)), new)
    token_starts = np.concatenate([[0], np.cumsum(new)])
    positions = cached[write_rows] + np.arange(int(token_starts[-1])) - token_starts[write_rows]
    flat = starts[write_rows] + positions // page_size
    return StepLayout(
        tenants=np.array([r.record.tenant for r in requests], dtype=np.int64),
        num_cached=cached,
        starts=starts,
        pages=pages,
        generations=generations,
        write_rows=write_rows,
        write_pages=pages[flat],
        write_generations=generations[flat],
        write_offsets=positions % page_size,
        write_positions=positions,
    )


def _redirect_a_write(layout: StepLayout) -> int | None:
    """Fault `stale_write`: the first new token of row 0 is written into another row's first page under a
    stale generation, as a writer holding an outdated mapping would. Returns the page written into, None
    when there is no other row to write into."""
    victims = np.flatnonzero(np.diff(layout.starts) > 0)
    victims = victims[victims != 0]
    if layout.write_rows.size == 0 or victims.size == 0:
        return None
    victim_page = layout.pages[layout.starts[victims[0]]]
    layout.write_pages[0] = victim_page
    layout.write_generations[0] = layout.generations[layout.starts[victims[0]]] - 1
    layout.write_offsets[0] = 0
    return int(victim_page)
