"""The runner's array-form `_model_inputs` against the per-row version it replaced (kept below as the
oracle): the same model inputs at every step of mixed runs (chunked prefill, prefix hits, decode, stops,
preemption), hence the same tokens, stop handling and audit events."""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch
from conftest import make_engine

from kvfence.cache.fence import StepLayout
from kvfence.engine.engine import LLMEngine
from kvfence.engine.runner import ModelRunner
from kvfence.model.transformer import PrefillSeq, StepInputs, Transformer
from kvfence.request import Request
from kvfence.sampling import SamplingParams


def per_row_model_inputs(
    runner: ModelRunner, requests: list[Request], num_new: list[int], layout: StepLayout
) -> tuple[StepInputs, list[int]]:
    """The per-row implementation as it was (kvfence 553e6b0), verbatim but for `self` and the tables'
    padding: the pool's zero page, not page 0 (another request's)."""
    device, ps = runner.model.device, runner.pool.page_size
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
    tables = torch.full((len(decode), max_pages), runner.pool.zero_page, dtype=torch.long)
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
        zero_page=runner.pool.zero_page,
    )
    return inputs, sample_rows


def assert_same_inputs(ours: StepInputs, theirs: StepInputs) -> None:
    for name in ("input_ids", "positions", "slot_mapping", "decode_rows", "decode_block_tables"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert a.dtype == b.dtype == torch.long and torch.equal(a, b), name
    for name in ("decode_context_lens", "logits_rows"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert ours.zero_page == theirs.zero_page
    assert len(ours.prefills) == len(theirs.prefills)
    for a, b in zip(ours.prefills, theirs.prefills, strict=True):
        assert (a.start, a.end, a.context_len) == (b.start, b.end, b.context_len)
        assert (a.block_table is None) == (b.block_table is None)
        assert a.block_table is None or torch.equal(a.block_table, b.block_table)


def small_engine(model: Transformer) -> LLMEngine:
    return make_engine(model, num_pages=24, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=96)


def run(engine: LLMEngine) -> tuple[list[list[int]], list[str | None], list[dict[str, object]]]:
    """Mixed traffic: shared prefixes (prefix hits), long prompts in chunks, stops by length, and a pool
    small enough to preempt."""
    prompts = [[(7 * i + j) % 200 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    prompts += [[*prompts[3][:20], 9, 9, 9], prompts[5][:30]]
    params = [SamplingParams(max_tokens=4 + 3 * (i % 4)) for i in range(len(prompts))]
    requests = engine.generate(prompts, params)
    events = [
        {k: v for k, v in event.items() if k not in ("ts", "seq")}
        for rid in engine.events.request_ids()
        for event in engine.events.for_request(rid)
    ]
    return [r.output_token_ids for r in requests], [r.finish_reason for r in requests], events


def test_array_form_inputs_equal_the_per_row_ones_at_every_step(tiny: Transformer) -> None:
    engine = small_engine(tiny)
    vectorised = engine.runner._model_inputs
    steps = []

    def checked(
        requests: list[Request], num_new: list[int], layout: StepLayout
    ) -> tuple[StepInputs, list[int], list[tuple[Request, int]]]:
        ours, rows, prompt_rows = vectorised(requests, num_new, layout)
        theirs, their_rows = per_row_model_inputs(engine.runner, requests, num_new, layout)
        assert_same_inputs(ours, theirs)
        assert rows == their_rows and prompt_rows == []  # no request here asks for prompt logprobs
        steps.append((len(ours.prefills), int(ours.decode_rows.numel())))
        return ours, rows, prompt_rows

    engine.runner._model_inputs = checked  # type: ignore[method-assign]
    outcome = run(engine)
    assert any(p and d for p, d in steps) and any(d and not p for p, d in steps)  # mixed and pure decode
    # The same run on the per-row inputs: the same tokens, finish reasons and audit events.
    reference = small_engine(tiny)
    reference.runner._model_inputs = lambda *a: (*per_row_model_inputs(reference.runner, *a), [])  # type: ignore[method-assign]
    assert run(reference) == outcome
    kinds = {event["kind"] for event in outcome[2]}
    assert {"preempted", "prefix_hit", "finished"} <= kinds
