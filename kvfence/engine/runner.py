"""One model step for a batch: build the step layout, validate it through the fence, run the model.

Order matters and is the point of this file: the fence sees the exact pages the step will read and write
*before* any of them is touched; rows it rejects are dropped and the layout is rebuilt without them, so
attention never runs over a page the fence did not clear.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from kvfence.cache.block_table import BlockTable
from kvfence.cache.fence import Fence, StepLayout
from kvfence.cache.pool import KVPool
from kvfence.engine.graphs import DecodeBatch, DecodeGraphRunner
from kvfence.engine.sampler import ban_tokens, hold_ends, raw_logprobs, sample, token_logprobs
from kvfence.grammar import mask as grammar_mask
from kvfence.model.transformer import PrefillSeq, StepInputs, Transformer
from kvfence.request import Request
from kvfence.sampling import TokenLogprobs
from kvfence.trail.faults import FaultInjector
from kvfence.units import cdiv

NON_FINITE_LOGITS = "non_finite_logits"  # the model produced NaN/inf for this row: abort it, not the batch

# Called with the rows about to run and their layout, after validation and before the model reads
# anything: tests and the lab use it to trace which pages each request really reads and writes.
StepObserver = Callable[[list[Request], StepLayout], None]
# Called with the sampled requests and their float32 logits [rows, vocab]: golden tests compare them.
LogitsObserver = Callable[[list[Request], torch.Tensor], None]
# (request, prompt position p) per row and the raw logits that predict token p, for requests that asked for
# prompt logprobs (bench/accuracy.py compares whole distributions).
PromptLogitsObserver = Callable[[list[tuple[Request, int]], torch.Tensor], None]


@dataclass
class StepResult:
    # request id -> new token, for rows that reached the end of their tokens (a fork parent's: its forks')
    sampled: dict[str, int]
    aborted: dict[str, str]  # request id -> fence violation, or NON_FINITE_LOGITS
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # for requests that asked for them
    # request id -> prompt position -> that prompt token's logprobs, for requests that asked for them
    prompt_logprobs: dict[str, dict[int, TokenLogprobs]] = field(default_factory=dict)
    # request id -> the drafts its verification accepted, in order, before its `sampled` token (rows that
    # verified drafts only; the rest of their drafts were rejected and their KV must be taken back)
    accepted: dict[str, list[int]] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: Transformer,
        pool: KVPool,
        fence: Fence,
        faults: FaultInjector,
        graphs: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.pool = pool
        self.fence = fence
        self.faults = faults
        self.graphs = graphs  # pure decode steps replayed from captured graphs (CUDA); None: all eager
        self.observer: StepObserver | None = None
        self.logits_observer: LogitsObserver | None = None
        self.prompt_logits_observer: PromptLogitsObserver | None = None
        self.eos_ids: frozenset[int] = (
            frozenset()
        )  # the tokenizer's (set by the engine): min_tokens holds them
        # The draws of sampled requests without a seed (one exponential race over the batch); seeded ones
        # draw from their own generator.
        self.noise = torch.Generator(device=model.device)
        self.noise.seed()

    def execute(self, requests: list[Request], num_new: list[int]) -> StepResult:
        layout = build_layout(requests, num_new, self.pool.page_size)
        if self.faults.fire("stale_write") and (page := _redirect_a_write(layout)) is not None:
            self.faults.record("stale_write", request_id=requests[0].request_id, page=page)
        reach = _rejected_draft_reach(requests, num_new, layout, self.pool.page_size)
        if reach is not None and self.faults.fire("read_rejected_draft"):
            row, extra = reach
            layout.num_cached[row] += extra  # its reads reach the slots; its writes stay where they were
            self.faults.record("read_rejected_draft", request_id=requests[row].request_id, slots=extra)
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
        logits, sample_rows, prompt_rows = self._forward(requests, num_new, layout)
        self.pool.commit_writes(layout.write_pages, layout.write_offsets)
        prompt = _prompt_logprobs(logits[: len(prompt_rows)], prompt_rows)
        if self.prompt_logits_observer is not None and prompt_rows:
            self.prompt_logits_observer(prompt_rows, logits[: len(prompt_rows)])
        logits = logits[len(prompt_rows) :]
        sampled_requests = [requests[r] for r in sample_rows]
        if self.logits_observer is not None:
            self.logits_observer(sampled_requests, logits)
        sampled_requests, logits = fork_rows(sampled_requests, logits)
        # One row per sampled position: a verifying request's every position, each sampled as if the drafts
        # before it were its output already (its penalties and min_tokens see them).
        rows = [(r, i) for r in sampled_requests for i in range(1 + len(r.draft_token_ids))]
        params = [r.params for r, _ in rows]
        raw = raw_logprobs(logits, params)  # before the masks: logprobs report the model's own distribution
        # Structured output: disallowed tokens go to -inf before sampling, then each matcher takes its token.
        grammars = [r.grammar for r, _ in rows]
        grammar_failed = grammar_mask.apply_masks(logits, grammars, [r.draft_token_ids[:i] for r, i in rows])
        hold_ends(logits, params, [len(r.output_token_ids) + i for r, i in rows], self.eos_ids)
        outputs = [r.output_token_ids + r.draft_token_ids[:i] if i else r.output_token_ids for r, i in rows]
        ban_tokens(logits, params, outputs)
        tokens = sample(
            logits,
            params,
            [r.generator for r, _ in rows],
            [r.prompt_token_ids for r, _ in rows],
            outputs,
            self.noise,
            consume=True,  # read by no one after: the masks above already wrote into them
        )
        sampled, accepted = {}, {}
        for row, request, picks in _per_request(rows, tokens):
            taken = verified(request.draft_token_ids, picks)
            token = picks[len(taken)]
            kept = None if token is None else grammar_mask.advance(request.grammar, [*taken, token])
            if kept is not None and kept <= len(taken):  # an accepted draft completed the grammar: it ends
                taken, token = taken[: kept - 1], taken[kept - 1]
            if row in grammar_failed or (token is not None and kept is None):
                aborted[request.request_id] = grammar_mask.GRAMMAR_ERROR
            elif token is None:
                aborted[request.request_id] = NON_FINITE_LOGITS
            else:
                sampled[request.request_id] = token
                if request.draft_token_ids:
                    accepted[request.request_id] = taken
        logprobs = {rows[row][0].request_id: lp for row, lp in token_logprobs(raw, tokens, params).items()}
        return StepResult(sampled, aborted, logprobs, prompt, accepted)

    def _forward(
        self, requests: list[Request], num_new: list[int], layout: StepLayout
    ) -> tuple[torch.Tensor, list[int], list[tuple[Request, int]]]:
        """The step's logits over the validated `layout`, the batch rows sampled and the prompt-logprob rows
        (`_model_inputs`'): a pure decode step replayed from its captured graph where one fits (the graph
        reads the same layout: its pages, slots and positions), else the eager forward."""
        if self.graphs is not None and (decode := _pure_decode(requests, num_new, layout)) is not None:
            page_size = self.pool.page_size
            logits = self.graphs.run(DecodeBatch.from_layout(layout, decode, page_size))
            if logits is not None:
                return logits, list(range(len(requests))), []
        inputs, sample_rows, prompt_rows = self._model_inputs(requests, num_new, layout)
        return self.model.forward(inputs, self.pool.kv), sample_rows, prompt_rows

    def _model_inputs(
        self, requests: list[Request], num_new: list[int], layout: StepLayout
    ) -> tuple[StepInputs, list[int], list[tuple[Request, int]]]:
        """The model's inputs from the validated layout, in array form: per row only the new tokens are
        read from the request (a decode row's one token, not a copy of its whole sequence); tables, row
        kinds and logits rows are numpy over the batch (at 256 decode rows this took 7.6 of a step's 41
        ms under cProfile, mostly a tensor per row). Also the batch rows sampled, and (request, prompt
        position) of each prompt token whose logprobs a request asked for: their logits rows come first."""
        device = self.model.device
        new = np.asarray(num_new, dtype=np.int64)
        cached = layout.num_cached  # what each row reads before its own tokens
        token_ends = np.cumsum(new)
        first = layout.write_positions[token_ends - new]  # where each row's tokens go (its computed mark)
        drafts = np.fromiter((len(r.draft_token_ids) for r in requests), np.int64, len(requests))
        input_ids = list(
            chain.from_iterable(
                _token_slice(r, f, f + n) for r, f, n in zip(requests, first.tolist(), num_new, strict=True)
            )
        )
        # A decode row is one token after its context, or that token and the drafts it verifies: each of
        # its positions attends as a decode row of its own (the batch-invariant path), over the context up
        # to it, so a verified position computes what decoding it alone would.
        is_decode = (new == 1 + drafts) & (cached > 0)
        sampled = (first + new == [r.num_tokens for r in requests] + drafts) & ~np.array(
            [r.prefill_only for r in requests], dtype=bool
        )
        decode = np.flatnonzero(is_decode)
        entries, steps = row_spans(decode, new[decode])  # each decode position: its row, its place in the row
        prompt_rows = _prompt_positions(requests, num_new, cached, token_ends)
        prefills = prefill_seqs(layout, np.flatnonzero(~is_decode), new, token_ends, device)
        tables = decode_tables(layout, entries, self.pool.zero_page)
        sample_rows = np.flatnonzero(sampled)
        spans = 1 + drafts[sample_rows]  # the positions each sampled row is sampled at: its last 1 + drafts
        sampled_at, place = row_spans(sample_rows, spans)
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.from_numpy(layout.write_positions).to(device),
            slot_mapping=torch.from_numpy(layout.write_pages * self.pool.page_size + layout.write_offsets).to(
                device
            ),
            decode_rows=torch.from_numpy(token_ends[entries] - new[entries] + steps).to(device),
            decode_block_tables=torch.from_numpy(tables).to(device),
            decode_context_lens=torch.from_numpy(cached[entries] + 1 + steps).to(device),
            prefills=prefills,
            logits_rows=torch.from_numpy(
                np.concatenate(
                    [
                        [row for row, _, _ in prompt_rows],
                        token_ends[sampled_at] - np.repeat(spans, spans) + place,
                    ]
                ).astype(np.int64)
            ).to(device),
            zero_page=self.pool.zero_page,
        )
        return inputs, sample_rows.tolist(), [(r, position) for _, r, position in prompt_rows]


def prefill_seqs(
    layout: StepLayout, rows: np.ndarray, new: np.ndarray, token_ends: np.ndarray, device: torch.device
) -> list[PrefillSeq]:
    """The prefill chunk of each of `rows` (the step's `new` tokens a row, ending at `token_ends`): its
    tokens in the step, its context, its pages where it attends over cached ones, and its pages always (the
    C prefill kernel reads a chunk's own K/V from them too)."""
    cached = layout.num_cached
    seqs = []
    for row in rows.tolist():
        pages = torch.from_numpy(layout.pages[layout.starts[row] : layout.starts[row + 1]]).to(device)
        start, end = int(token_ends[row] - new[row]), int(token_ends[row])
        seqs.append(
            PrefillSeq(start, end, int(cached[row] + new[row]), pages if cached[row] else None, pages)
        )
    return seqs


def row_spans(rows: np.ndarray, widths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each of `rows` repeated its width times, and the place of each repeat within its row (0, 1, ...)."""
    repeated = np.repeat(rows, widths)
    return repeated, np.arange(repeated.size) - np.repeat(np.cumsum(widths) - widths, widths)


def verified(drafts: list[int], picks: list[int | None]) -> list[int]:
    """The drafts accepted: the longest prefix the target picked itself, position by position (`picks[i]`
    sampled after drafts[:i]). With one draft token proposed per position, sampling the target and comparing
    is rejection sampling exactly: a draft is kept with the target's probability of it, and where it is
    not, the pick is a draw from the target without it. The row's token is then `picks[len(accepted)]`."""
    taken = 0
    while taken < len(drafts) and picks[taken] == drafts[taken]:
        taken += 1
    return drafts[:taken]


def _per_request(
    rows: list[tuple[Request, int]], tokens: list[int | None]
) -> Iterator[tuple[int, Request, list[int | None]]]:
    """(first row, request, its picks) for each request of the sampled `rows` (a verifier spans several)."""
    row = 0
    while row < len(rows):
        request = rows[row][0]
        span = 1 + len(request.draft_token_ids)
        yield row, request, tokens[row : row + span]
        row += span


def _rejected_draft_reach(
    requests: list[Request], num_new: list[int], layout: StepLayout, page_size: int
) -> tuple[int, int] | None:
    """Fault `read_rejected_draft`'s target: the first row whose last verification took back more slots than
    its next token overwrites, and how many of them its reads would reach within the pages the step maps
    (as a verifier that counted its rejected drafts would read them). None when no row has such slots."""
    for row, request in enumerate(requests):
        if request.draft_tail < 2 or layout.num_cached[row] == 0:
            continue
        mapped = (layout.starts[row + 1] - layout.starts[row]) * page_size
        extra = min(request.draft_tail - 1, int(mapped - layout.num_cached[row] - num_new[row]))
        if extra > 0:
            return row, extra
    return None


def _pure_decode(requests: list[Request], num_new: list[int], layout: StepLayout) -> np.ndarray | None:
    """The token each row feeds when the step is pure decode as a graph replays it, else None: every row one
    token after a cached context, its last, sampled (so no prompt token's logprobs are computed)."""
    cached = layout.num_cached.tolist()
    for request, n, c in zip(requests, num_new, cached, strict=True):
        if n != 1 or c == 0 or c + 1 != request.num_tokens or request.prefill_only:
            return None
    return np.array([_token_slice(r, c, c + 1)[0] for r, c in zip(requests, cached, strict=True)])


def _prompt_positions(
    requests: list[Request], num_new: list[int], cached: np.ndarray, token_ends: np.ndarray
) -> list[tuple[int, Request, int]]:
    """(step row, request, prompt position) for every prompt token this step computes the logits before,
    of the requests that asked for prompt logprobs: the logits at position p give token p + 1's."""
    found = []
    for row, (request, n) in enumerate(zip(requests, num_new, strict=True)):
        if request.params.prompt_logprobs is None:
            continue
        first = int(cached[row])
        for p in range(first, min(first + n, len(request.prompt_token_ids) - 1)):
            found.append((int(token_ends[row]) - n + p - first, request, p + 1))
    return found


def _prompt_logprobs(
    logits: torch.Tensor, rows: list[tuple[Request, int]]
) -> dict[str, dict[int, TokenLogprobs]]:
    """Each prompt token's logprob at `logits`' rows (log-softmax of the raw logits, as for sampled
    tokens) and the request's `prompt_logprobs` most likely tokens there."""
    if not rows:
        return {}
    logp = torch.log_softmax(logits.float(), dim=-1)
    found: dict[str, dict[int, TokenLogprobs]] = {}
    for (request, position), row in zip(rows, logp, strict=True):
        token, k = request.prompt_token_ids[position], request.params.prompt_logprobs or 0
        values, ids = torch.topk(row, k) if k else (row[:0], row[:0].long())
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
        rank = int((row > row[token]).sum()) + 1
        entry = TokenLogprobs(token, float(row[token]), top, rank)
        found.setdefault(request.request_id, {})[position] = entry
    return found


def _token_slice(request: Request, start: int, end: int) -> list[int]:
    """Tokens [start, end) of prompt + output + this step's drafts, without building the whole sequence."""
    prompt, done = len(request.prompt_token_ids), request.num_tokens
    if end > done:  # a verifying row: its last sampled token, then its drafts
        return _token_slice(request, start, done) + request.draft_token_ids[: end - done]
    if start >= prompt:
        return request.output_token_ids[start - prompt : end - prompt]
    return request.prompt_token_ids[start:end] + request.output_token_ids[: max(end - prompt, 0)]


def decode_tables(layout: StepLayout, rows: np.ndarray, pad_page: int) -> np.ndarray:
    """[len(rows), widest] int64: each row's pages from the layout, padded with `pad_page` (the pool's zero
    page: past a row's length nothing is read, the kernel stops at its pages and SDPA gathers the zero page,
    yet the table names no page another request holds)."""
    begins, counts = layout.starts[rows], np.diff(layout.starts)[rows]
    tables = np.full((rows.size, int(counts.max(initial=0))), pad_page, dtype=np.int64)
    which = np.repeat(np.arange(rows.size), counts)
    columns = np.arange(which.size) - np.repeat(np.cumsum(counts) - counts, counts)
    tables[which, columns] = layout.pages[np.repeat(begins, counts) + columns]
    return tables


def fork_rows(requests: list[Request], logits: torch.Tensor) -> tuple[list[Request], torch.Tensor]:
    """Who samples each row: a parent at the end of its prompt is sampled by its forks (n > 1), each with
    its own generator from a copy of the parent's one row, so a fork samples exactly what a request on its
    own would; every other request samples its own row."""
    if not any(r.forks for r in requests):
        return requests, logits
    rows = [row for row, r in enumerate(requests) for _ in r.forks or [r]]
    return [s for r in requests for s in r.forks or [r]], logits[rows]


def build_layout(requests: list[Request], num_new: list[int], page_size: int) -> StepLayout:
    """Flatten the batch's records: the pages each row reads/writes this step and every new token's slot,
    written in place into one StepLayout. The pages come from the block table's rows in one gather (the
    records of an engine's requests all live in its cache manager's table)."""
    records = [r.record for r in requests]
    table = records[0].table if records else BlockTable(rows=0)
    if any(record.table is not table for record in records):
        raise ValueError("a batch's records must share one block table")
    count = len(requests)
    cached = np.fromiter((r.num_computed_tokens for r in requests), dtype=np.int64, count=count)
    new = np.array(num_new, dtype=np.int64)
    mapped = cdiv(cached + new, page_size)  # pages covering every token the step touches
    pages, generations = table.gather(np.fromiter((r.row for r in records), np.int64, count), mapped)
    layout = StepLayout.empty(count, pages.size, int(new.sum()))
    layout.starts[0] = 0
    np.cumsum(mapped, out=layout.starts[1:])
    layout.tenants[:] = np.fromiter((r.tenant for r in records), np.int64, count)
    layout.num_cached[:] = cached
    layout.pages[:] = pages
    layout.generations[:] = generations
    write_rows = layout.write_rows
    write_rows[:] = np.repeat(np.arange(len(requests)), new)
    token_starts = np.concatenate([[0], np.cumsum(new)])
    positions = layout.write_positions
    positions[:] = cached[write_rows] + np.arange(write_rows.size) - token_starts[write_rows]
    flat = layout.starts[write_rows] + positions // page_size
    layout.write_pages[:] = layout.pages[flat]
    layout.write_generations[:] = layout.generations[flat]
    layout.write_offsets[:] = positions % page_size
    return layout


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
