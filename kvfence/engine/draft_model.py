"""Speculative decoding with a draft model (vLLM's "draft_model"): a smaller model of the target's vocabulary
proposes each row's next k tokens greedily, in forwards of its own batched over the step's rows, and the
target verifies them in one forward (runner.py) as it verifies prompt lookup's.

The draft model's KV is a pool of its own, paged and fenced as the target's is: each request's draft
sequence holds fresh pages under its tenant, every draft forward's layout is validated by a Fence over that
pool before the draft model reads or writes a slot, and what the target rejected is taken back through
`Fence.roll_back` (zeroed, `written` moved back) before the sequence grows again. No page is shared between
sequences (no prefix cache), so a draft is computed from its own request's tokens only. Drafts never decide
output: greedy output is what decoding alone gives, sampled output follows the target (a draft is kept
with the target's probability of it, runner.verified).

Contract: `prepare(wants)` brings each wanted request's draft sequence up to its tokens (at most
`catch_up` prompt tokens a step over all rows: a long prompt is fed over several steps, drafting nothing
until it is in) and draws up to k greedy tokens for each; `propose(request, k)` hands out the first k of
them, none where nothing was prepared. A request whose sequence finds no free draft pages proposes nothing
(its pages go back; it starts over later). One whose sequence the fence refuses is reported by
`take_violations` (the engine aborts it) and its sequence dropped. `forget` releases a request's pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvfence.cache.allocator import PageAllocator
from kvfence.cache.block_table import BlockTable
from kvfence.cache.fence import Fence, MappingRecord, StepLayout
from kvfence.cache.pool import KVPool
from kvfence.config import MAX_SPECULATIVE_TOKENS
from kvfence.engine.drafter import Drafted, Drafter
from kvfence.engine.runner import build_layout, decode_tables, prefill_seqs, row_spans
from kvfence.model.transformer import StepInputs, Transformer
from kvfence.trail.faults import FaultInjector
from kvfence.units import cdiv


@dataclass
class DraftSequence:
    """One request's tokens in the draft pool: `fed` are the tokens whose KV its record's pages hold."""

    request_id: str
    record: MappingRecord
    fed: list[int] = field(default_factory=list)
    known: int = 0  # how many of `fed` were the request's own tokens (not drafts) when last fed

    @property
    def num_computed_tokens(self) -> int:  # what build_layout reads: the slots already written
        return len(self.fed)


class DraftModelDrafter(Drafter):
    def __init__(self, model: Transformer, pool: KVPool, fenced: bool = True, catch_up: int = 512) -> None:
        self.model, self.pool = model, pool
        self.allocator = PageAllocator(pool, None, FaultInjector())
        self.fence = Fence(pool, enabled=fenced)
        self.table = BlockTable()
        self.catch_up = catch_up
        self.sequences: dict[str, DraftSequence] = {}
        self._proposals: dict[str, list[int]] = {}
        self._violations: dict[str, str] = {}

    def prepare(self, wants: Sequence[tuple[Drafted, int]]) -> None:
        self._proposals = {}
        budget, rows, wanted = self.catch_up, [], {}
        for request, k in wants:
            seq = self._synced(request) if k > 0 else None
            if seq is None:
                continue
            new = request.all_token_ids[len(seq.fed) :]
            if len(new) > MAX_SPECULATIVE_TOKENS + 1:  # a prompt to catch up on, not a verification's tail
                if len(new) > budget:  # more than is left of the step's budget: part of it now, no drafts
                    if budget:
                        rows.append((seq, new[:budget]))
                        budget = 0
                    continue
                budget -= len(new)
            rows.append((seq, new))
            seq.known, wanted[seq.request_id] = len(seq.fed) + len(new), k
        while rows:
            picks = self._forward(rows)
            rows = []
            for seq, token in picks:
                if seq.request_id not in wanted:
                    continue  # fed a chunk of its prompt: drafts come once the whole of it is in
                drafts = self._proposals.setdefault(seq.request_id, [])
                drafts.append(token)
                if len(drafts) < wanted[seq.request_id]:
                    rows.append((seq, [token]))

    def propose(self, request: Drafted, k: int) -> list[int]:
        return self._proposals.get(request.request_id, [])[:k]

    def forget(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        self._proposals.pop(request_id, None)
        if seq is not None and len(seq.record):
            self.allocator.release(seq.record)

    def take_violations(self) -> dict[str, str]:
        taken, self._violations = self._violations, {}
        return taken

    def _synced(self, request: Drafted) -> DraftSequence | None:
        """The request's draft sequence cut back to the longest prefix of its tokens it holds (and never its
        last token: the draft's logits after it are the first draft), the cut taken back by the fence."""
        seq = self.sequences.get(request.request_id)
        if seq is None:
            tenant = self.allocator.tenant_id(request.tenant)
            seq = self.sequences[request.request_id] = DraftSequence(
                request.request_id, MappingRecord(tenant, table=self.table)
            )
        tokens = request.all_token_ids
        keep = seq.known  # drafts fed after the last known token: kept where the request's tokens agree
        while keep < min(len(seq.fed), len(tokens) - 1) and seq.fed[keep] == tokens[keep]:
            keep += 1
        keep = min(keep, len(tokens) - 1)
        if keep < len(seq.fed):
            violation = self.fence.roll_back(seq.record, keep, len(seq.fed))
            if violation is not None:
                self._refuse(seq, violation)
                return None
            del seq.fed[keep:]
        seq.known = len(seq.fed)
        return seq

    def _forward(self, rows: list[tuple[DraftSequence, list[int]]]) -> list[tuple[DraftSequence, int]]:
        """Feed each row's tokens through the draft model, fenced; the greedy token after each row's last.
        Rows without pages for their tokens, or refused by the fence, are dropped (and their sequences)."""
        rows = [(seq, new) for seq, new in rows if self._pages_for(seq, len(seq.fed) + len(new))]
        if not rows:
            return []
        layout = self._layout(rows)
        verdict = self.fence.validate_step(layout)
        if verdict:
            for row, reason in verdict.items():
                self._refuse(rows[row][0], reason)
            rows = [r for i, r in enumerate(rows) if i not in verdict]
            if not rows:
                return []
            layout = self._layout(rows)
        logits = self.model.forward(self._inputs(rows, layout), self.pool.kv)
        self.pool.commit_writes(layout.write_pages, layout.write_offsets)
        for seq, new in rows:
            seq.fed.extend(new)
        return list(zip((seq for seq, _ in rows), logits.argmax(dim=-1).tolist(), strict=True))

    def _layout(self, rows: list[tuple[DraftSequence, list[int]]]) -> StepLayout:
        return build_layout([seq for seq, _ in rows], [len(new) for _, new in rows], self.pool.page_size)

    def _pages_for(self, seq: DraftSequence, tokens: int) -> bool:
        """Pages covering `tokens` tokens of the sequence; where the pool has too few free, the sequence
        gives back what it holds and drafts nothing this step."""
        needed = cdiv(tokens, self.pool.page_size) - len(seq.record)
        if needed > self.allocator.num_free_pages:
            self.forget(seq.request_id)
            return False
        if needed > 0:
            self.allocator.allocate(seq.record, needed)
        return True

    def _refuse(self, seq: DraftSequence, reason: str) -> None:
        self._violations[seq.request_id] = reason
        self.forget(seq.request_id)

    def _inputs(self, rows: list[tuple[DraftSequence, list[int]]], layout: StepLayout) -> StepInputs:
        """The draft forward's inputs from the validated layout. A row of a few tokens after its context
        (a verification's kept tokens, or one draft) is decode rows, a position each over the context up to
        it, as the runner verifies: a forward of only those is one C call over every layer. Any other row (a
        prompt to catch up on) is a prefill chunk. Logits at each row's last token."""
        device, size = self.model.device, self.pool.page_size
        new = np.array([len(tokens) for _, tokens in rows], dtype=np.int64)
        cached, ends = layout.num_cached, np.cumsum(new)
        is_decode = (cached > 0) & (new <= MAX_SPECULATIVE_TOKENS + 1)
        decode = np.flatnonzero(is_decode)
        entries, steps = row_spans(decode, new[decode])  # each decode position: its row, its place in the row
        prefills = prefill_seqs(layout, np.flatnonzero(~is_decode), new, ends, device)
        tables = decode_tables(layout, entries, self.pool.zero_page)
        return StepInputs(
            input_ids=torch.tensor([t for _, new in rows for t in new], dtype=torch.long, device=device),
            positions=torch.from_numpy(layout.write_positions).to(device),
            slot_mapping=torch.from_numpy(layout.write_pages * size + layout.write_offsets).to(device),
            decode_rows=torch.from_numpy(ends[entries] - new[entries] + steps).to(device),
            decode_block_tables=torch.from_numpy(tables).to(device),
            decode_context_lens=torch.from_numpy(cached[entries] + 1 + steps).to(device),
            prefills=prefills,
            logits_rows=torch.from_numpy(ends - 1).to(device),
            zero_page=self.pool.zero_page,
        )
