"""The worker side: validate the block-table rows a step is about to run against the scheduler's plan,
neutralise the rows that fail, and the fault that swaps two rows.

`check_rows` compares, in one numpy pass, each planned request's row of vLLM's worker block table (its
length and its first entries) with the blocks its record holds: any difference (another request's
blocks, a block too many or too few, a request the batch does not hold) condemns that request alone as
reading blocks not its own (FOREIGN_OWNER). `neutralise` points a condemned row at vLLM's null block
(id 0), so the step it still takes part in reads and writes no request's KV; its sampled token is
dropped by the scheduler and the request ends in an error (patches.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import numpy as np

from kvfence.trail.reasons import FOREIGN_OWNER
from kvfence_vllm.records import StepPlan

NULL_BLOCK = 0  # vLLM's BlockPool reserves block 0 as a placeholder no request's KV lives in


def check_rows(
    plan: StepPlan, row_of: Mapping[str, int], table: np.ndarray, lengths: np.ndarray
) -> dict[str, str]:
    """Planned requests whose worker row differs from their record (request id -> reason)."""
    if not plan.req_ids:
        return {}
    rows = np.array([row_of.get(req_id, -1) for req_id in plan.req_ids], dtype=np.int64)
    counts = np.diff(plan.starts)
    present = rows >= 0
    bad = ~present | (lengths[np.where(present, rows, 0)] != counts) | (counts > table.shape[1])
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
    return {plan.req_ids[i]: FOREIGN_OWNER for i in np.flatnonzero(bad).tolist()}


def _entries(plan: StepPlan, chosen: np.ndarray) -> np.ndarray:
    """The plan's pages of the chosen requests, concatenated in order."""
    if chosen.all():
        return plan.pages
    counts = np.diff(plan.starts)
    owners = np.repeat(np.arange(counts.size), counts)
    return plan.pages[chosen[owners]]


def neutralise(table: np.ndarray, lengths: np.ndarray, rows: list[int]) -> None:
    for row in rows:
        table[row, : lengths[row]] = NULL_BLOCK


def choose_swap(rng: random.Random, probability: float, running: list[int]) -> tuple[int, int] | None:
    """The fault's draw for one step: two of the `running` rows to swap, or None."""
    if len(running) < 2 or rng.random() >= probability:
        return None
    first, second = rng.sample(running, 2)
    return first, second
