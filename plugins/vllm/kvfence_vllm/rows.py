"""The worker side: validate the block-table rows a step is about to run against the scheduler's plan,
neutralise the rows that fail, and the faults' draws (two rows swapped, one start moved ahead).

`check_rows` compares, in one numpy pass, each planned request's row of vLLM's worker block table (its
length and its first entries) with the blocks its record holds: any difference (another request's
blocks, a block too many or too few, a request the batch does not hold) condemns that request alone as
reading blocks not its own (FOREIGN_OWNER). A request whose row is its own but whose start position (the
input batch's num_computed_tokens, where the step's positions and attention begin) differs from its
record's written length, or whose row cannot hold the written and scheduled tokens, would attend over KV
no step wrote for it (UNWRITTEN_READ). `neutralise` points a condemned row, its whole width, at vLLM's
null block (id 0), so the step it still takes part in reads and writes no request's KV; its sampled token
is dropped by the scheduler and the request ends in an error (patches.py). `judge` is the step's whole
verdict: those, the scheduler's condemned, and the requests that counted a condemned one's fills.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np

from kvfence.trail.reasons import FOREIGN_OWNER, UNWRITTEN_READ
from kvfence_vllm.records import StepPlan

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as a placeholder no request's KV lives in


def check_rows(
    plan: StepPlan, row_of: Mapping[str, int], table: np.ndarray, lengths: np.ndarray, computed: np.ndarray
) -> dict[str, str]:
    """Planned requests whose worker row differs from their record, or whose start (`computed`, per row)
    is not their record's written length (request id -> reason)."""
    if not plan.req_ids:
        return {}
    rows = np.array([row_of.get(req_id, -1) for req_id in plan.req_ids], dtype=np.int64)
    counts = np.diff(plan.starts)
    present = rows >= 0
    safe = np.where(present, rows, 0)
    bad = ~present | (lengths[safe] != counts) | (counts > table.shape[1])
    good = ~bad & (counts > 0)
    if good.any():
        width = int(counts[good].max())
        keep = np.arange(width) < counts[good][:, None]
        mapped = table[rows[good], :width][keep]
        expected = _entries(plan, good)
        wrong = mapped != expected
        if wrong.any():
            owners = np.repeat(np.flatnonzero(good), counts[good])
            bad[np.unique(owners[wrong])] = True
    verdict = {plan.req_ids[i]: FOREIGN_OWNER for i in np.flatnonzero(bad).tolist()}
    ahead = (computed[safe] != plan.written) | (counts * plan.block_size < plan.written + plan.scheduled)
    verdict.update({plan.req_ids[i]: UNWRITTEN_READ for i in np.flatnonzero(ahead & ~bad).tolist()})
    return verdict


def judge(
    plan: StepPlan, row_of: Mapping[str, int], table: np.ndarray, lengths: np.ndarray, computed: np.ndarray
) -> dict[str, str]:
    """The step's verdict: `check_rows`, the scheduler's condemned, and the requests counting a fill of
    one of those (StepPlan.spread)."""
    return plan.spread(check_rows(plan, row_of, table, lengths, computed) | plan.condemned)


def _entries(plan: StepPlan, chosen: np.ndarray) -> np.ndarray:
    """The plan's pages of the chosen requests, concatenated in order."""
    if chosen.all():
        return plan.pages
    counts = np.diff(plan.starts)
    owners = np.repeat(np.arange(counts.size), counts)
    return plan.pages[chosen[owners]]


def neutralise(table: np.ndarray, rows: list[int]) -> None:
    """Whole rows, not their lengths: a start moved ahead reaches entries past a row's length."""
    table[rows] = NULL_BLOCK


def choose_rows(rng: random.Random, probability: float, running: list[int], count: int) -> list[int] | None:
    """A fault's draw for one step: `count` distinct rows of the candidate `running` ones, or None (no
    draw is made while there are fewer than `count`)."""
    if len(running) < count or rng.random() >= probability:
        return None
    return rng.sample(running, count)


def decoding_rows(
    computed: np.ndarray, prompt: np.ndarray, scheduled: np.ndarray, block_size: int, window: int
) -> list[int]:
    """Rows past their prompt whose step, its start moved a block ahead, still fits the window (beyond it
    vLLM's own per-request arrays end): the rows the fault inflate_computed may move."""
    fits = computed + scheduled + block_size <= window
    return np.flatnonzero((prompt > 0) & (computed >= prompt) & fits).tolist()
