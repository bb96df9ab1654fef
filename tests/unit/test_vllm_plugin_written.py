"""The vLLM plugin's written lengths without vLLM (plugins/vllm, issue 62): each record's written length,
kept apart from vLLM's num_computed_tokens, and the worker's check that a step starts where its request's
KV was written. Synthetic steps: the scheduler side plans, the worker side checks its rows and starts (rows
equal to the records unless a test says otherwise), and the step's commit advances what was written. And
the faults that break it in the worker (faults.py) on a stand-in for vLLM's input batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import SimpleNamespace

import numpy as np

from kvfence.trail.reasons import FOREIGN_OWNER, UNWRITTEN_READ
from kvfence_vllm.faults import WorkerFaults
from kvfence_vllm.records import SchedulerRecords, StepPlan
from kvfence_vllm.rows import check_rows, judge
from kvfence_vllm.settings import Settings, from_environ
from kvfence_vllm.tags import BlockTags

SIZE = 16  # tokens per block


def records_with(blocks: int = 32) -> SchedulerRecords:
    return SchedulerRecords(BlockTags(blocks), block_size=SIZE)


def run_step(
    records: SchedulerRecords,
    scheduled: Sequence[tuple[str, Sequence[int], int]],
    starts: Mapping[str, int],
    rejected: Mapping[str, int] | None = None,
    rows: Mapping[str, Sequence[int]] | None = None,
    spread: bool = True,
) -> tuple[StepPlan, dict[str, str]]:
    """Plan (request id, block ids, tokens) for tenant "t", judge the worker's rows (each its record's, or
    `rows` where given) with the worker's start per request (`starts`), then commit the step as having run.
    `spread=False`: the verdict without StepPlan.spread (the protection a test turns off)."""
    plan = records.plan([(req_id, "t", ids, count) for req_id, ids, count in scheduled])
    table = np.zeros((len(scheduled), 8), dtype=np.int32)
    lengths = np.zeros(len(scheduled), dtype=np.int32)
    for row, (req_id, ids, _) in enumerate(scheduled):
        ids = (rows or {}).get(req_id, ids)
        table[row, : len(ids)], lengths[row] = ids, len(ids)
    computed = np.array([starts[req_id] for req_id, _, _ in scheduled], dtype=np.int64)
    row_of = {req_id: row for row, (req_id, _, _) in enumerate(scheduled)}
    if spread:
        verdict = judge(plan, row_of, table, lengths, computed)
    else:
        verdict = check_rows(plan, row_of, table, lengths, computed) | plan.condemned
    records.commit(plan, rejected or {}, verdict)
    return plan, verdict


def test_steps_that_start_where_their_kv_was_written_pass_and_advance_the_written_length() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    assert run_step(records, [("a", [1, 2], 20)], {"a": 0})[1] == {}  # a 20-token prefill
    assert records.written["a"] == 20 and records.tags.written[[1, 2]].tolist() == [16, 4]
    plan, verdict = run_step(records, [("a", [1, 2], 1)], {"a": 20})  # its first decode step
    assert verdict == {} and plan.written.tolist() == [20] and plan.scheduled.tolist() == [1]
    assert records.written["a"] == 21 and records.tags.written[[1, 2]].tolist() == [16, 5]


def test_a_start_ahead_of_the_written_length_aborts_that_request_alone() -> None:
    records = records_with()
    records.tags.handed_out([1, 2, 3, 4])
    run_step(records, [("a", [1, 2], 20), ("b", [3, 4], 18)], {"a": 0, "b": 0})
    # vLLM's count for "a" runs a block ahead of what was written (a claim of KV never loaded)
    verdict = run_step(records, [("a", [1, 2], 1), ("b", [3, 4], 1)], {"a": 20 + SIZE, "b": 18})[1]
    assert verdict == {"a": UNWRITTEN_READ}
    assert records.written == {"a": 20, "b": 19}  # the aborted step wrote nothing for "a"
    assert records.tags.written[[1, 2, 3, 4]].tolist() == [16, 4, 16, 3]


def test_a_start_behind_the_written_length_and_a_row_too_short_for_the_step_abort_too() -> None:
    records = records_with()
    records.tags.handed_out([1, 2, 3])
    run_step(records, [("a", [1, 2], 20)], {"a": 0})
    assert run_step(records, [("a", [1, 2], 1)], {"a": 19})[1] == {"a": UNWRITTEN_READ}
    # 20 tokens scheduled into one block of 16: the row cannot hold what the step writes and reads
    assert run_step(records, [("c", [3], 20)], {"c": 0})[1] == {"c": UNWRITTEN_READ}


def test_preemption_resets_the_written_length_to_the_prefix_hit_of_its_own_full_blocks() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    run_step(records, [("a", [1, 2], 20)], {"a": 0})
    run_step(records, [("a", [1, 2], 1)], {"a": 20})
    records.forget("a")  # preempted: vLLM frees its blocks and sets num_computed_tokens to 0
    records.tags.freed([1, 2])
    assert "a" not in records.written
    records.tags.revived([1])  # it resumes on its cached full block, and a fresh one for the rest
    records.tags.handed_out([5])
    assert run_step(records, [("a", [1, 5], 5)], {"a": 16})[1] == {}
    assert records.written["a"] == 21
    records.forget("a")
    records.tags.freed([1, 5])
    records.tags.revived([1])
    records.tags.handed_out([6])
    # vLLM's count kept from before the preemption is ahead of what the new record holds as written
    assert run_step(records, [("a", [1, 6], 1)], {"a": 21})[1] == {"a": UNWRITTEN_READ}


def test_a_prefix_hit_counts_only_full_blocks_written_and_kept_after_their_request_finished() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    run_step(records, [("a", [1, 2], 26)], {"a": 0})
    records.forget("a")  # finished: its blocks stay cached with what was written in them
    records.tags.freed([1, 2])
    records.tags.revived([1])
    records.tags.handed_out([3])
    assert run_step(records, [("b", [1, 3], 4)], {"b": SIZE})[1] == {}
    records.tags.revived([2])  # a hit counted past the cached full blocks: block 2 holds 10 tokens
    assert run_step(records, [("c", [1, 2], 1)], {"c": 2 * SIZE})[1] == {"c": UNWRITTEN_READ}


def test_a_same_step_hit_on_a_block_an_earlier_request_of_the_step_fills_passes() -> None:
    records = records_with()
    records.tags.handed_out([1, 2, 3, 4])
    step = [("a", [1, 2], 32), ("b", [1, 3], 4)]  # b hits a's first block, which this step fills
    assert run_step(records, step, {"a": 0, "b": SIZE})[1] == {}
    assert records.written == {"a": 32, "b": 20}
    # a block the step does not fill is not a hit: the prefill writes 10 of its 16 slots
    verdict = run_step(records, [("c", [4], 10), ("d", [4, 3], 1)], {"c": 0, "d": SIZE})[1]
    assert verdict == {"d": UNWRITTEN_READ}


def test_a_same_step_hit_on_a_block_its_condemned_filler_never_wrote_is_aborted_too() -> None:
    """a fills block 1 this step and b hits it; the worker condemns a (its row is not its record's), so a's
    row reads and writes only the null block and block 1 stays unwritten. Without the spread b passes and
    its record counts block 1 written; with it b is aborted, and c, hitting b's fill, after it."""
    step = [("a", [1, 2], 32), ("b", [1, 3], 16), ("c", [1, 3, 4], 1)]
    starts, wrong_row = {"a": 0, "b": SIZE, "c": 2 * SIZE}, {"a": [5, 2]}
    records = records_with()
    records.tags.handed_out([1, 2, 3, 4])
    _, verdict = run_step(records, step, starts, rows=wrong_row, spread=False)
    assert verdict == {"a": FOREIGN_OWNER}
    assert records.written["b"] == 32 and records.tags.written[1] == 0  # counted, never written: the leak
    records = records_with()
    records.tags.handed_out([1, 2, 3, 4])
    plan, verdict = run_step(records, step, starts, rows=wrong_row)
    assert plan.fillers == {"b": {"a"}, "c": {"a", "b"}}
    assert verdict == {"a": FOREIGN_OWNER, "b": UNWRITTEN_READ, "c": UNWRITTEN_READ}
    assert records.tags.written[[1, 3, 4]].tolist() == [0, 0, 0]  # no commit counted the unwritten blocks


def test_a_request_the_scheduler_condemns_takes_its_same_step_dependants_with_it() -> None:
    records = records_with()
    records.tags.handed_out([1, 2, 3, 4])
    records.tags.freed([2])  # a's second block is free while a maps it
    plan = records.plan([("a", "t", [1, 2], 32), ("b", "t", [1, 3], 16), ("d", "t", [4], 4)])
    assert set(plan.condemned) == {"a", "b"} and plan.condemned["b"] == UNWRITTEN_READ


def test_rejected_draft_tokens_are_rolled_back_as_vllm_rolls_back_its_count() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    run_step(records, [("a", [1, 2], 20)], {"a": 0})
    run_step(records, [("a", [1, 2], 4)], {"a": 20}, rejected={"a": 2})  # 1 token and 3 drafts, 1 kept
    assert records.written["a"] == 22 and records.tags.written[2] == 6
    assert run_step(records, [("a", [1, 2], 1)], {"a": 22})[1] == {}
    assert run_step(records, [("a", [1, 2], 1)], {"a": 25})[1] == {"a": UNWRITTEN_READ}


class FakeTables(list):
    """vLLM's MultiGroupBlockTable as the faults use it: `[0].block_size` and `swap_row`."""

    def __init__(self) -> None:
        super().__init__([SimpleNamespace(block_size=SIZE)])
        self.swaps: list[tuple[int, int]] = []

    def swap_row(self, first: int, second: int) -> None:
        self.swaps.append((first, second))


def batch_of(computed: list[int], prompts: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        num_reqs=len(computed),
        req_ids=[f"r{i}" for i in range(len(computed))],
        num_computed_tokens_cpu=np.array(computed, dtype=np.int64),
        num_prompt_tokens=np.array(prompts, dtype=np.int64),
        block_table=FakeTables(),
    )


def test_inflate_computed_moves_one_decoding_start_a_block_ahead_once_and_never_a_request_alone() -> None:
    faults = WorkerFaults(Settings(inflate_probability=1.0))
    alone = batch_of([30], [20])
    faults.inject(alone, {"r0": 1}, window=1024)
    assert alone.num_computed_tokens_cpu.tolist() == [30] and faults.inflated is None
    batch = batch_of([30, 0, 1010], [20, 12, 900])  # decoding, prefilling, decoding too near the window
    faults.inject(batch, {"r0": 1, "r1": 12, "r2": 1}, window=1024)
    assert batch.num_computed_tokens_cpu.tolist() == [30 + SIZE, 0, 1010] and faults.inflated == "r0"
    faults.inject(batch, {"r0": 1, "r1": 12, "r2": 1}, window=2048)
    assert batch.num_computed_tokens_cpu.tolist() == [30 + SIZE, 0, 1010]  # at most once


def test_inflate_computed_moves_the_decoding_request_furthest_along_the_earliest_on_a_tie() -> None:
    """Whom the move hits is known before the step (tests/vllm's scenario names it): no draw among rows."""
    for computed, moved in (([30, 0, 45, 40], 2), ([30, 45, 0, 45], 1), ([50, 45, 0, 45], 0)):
        faults = WorkerFaults(Settings(inflate_probability=1.0))
        batch = batch_of(computed, [20, 12, 20, 20])
        faults.inject(batch, {f"r{i}": 1 for i in range(4)}, window=1024)
        expected = [c + SIZE * (i == moved) for i, c in enumerate(computed)]
        assert batch.num_computed_tokens_cpu.tolist() == expected and faults.inflated == f"r{moved}"


def test_the_swap_spares_the_inflated_request_and_the_move_spares_a_swapped_one() -> None:
    faults = WorkerFaults(Settings(swap_probability=1.0, inflate_probability=1.0))
    batch = batch_of([30, 40], [20, 12])
    batch.num_prompt_tokens[:] = [50, 50]  # both still prefilling: nothing to move, the swap fires
    faults.inject(batch, {"r0": 1, "r1": 1}, window=1024)
    assert batch.block_table.swaps == [(0, 1)] or batch.block_table.swaps == [(1, 0)]
    three = batch_of([30, 40, 25], [20, 12, 10])
    faults.inject(three, {"r0": 1, "r1": 1, "r2": 1}, window=1024)
    assert faults.inflated == "r2" and three.num_computed_tokens_cpu.tolist() == [30, 40, 25 + SIZE]
    assert three.block_table.swaps in ([(0, 1)], [(1, 0)])  # r2 is spared


def test_a_fault_spec_arms_both_faults_and_their_draws_are_repeatable() -> None:
    settings = from_environ({"KVFENCE_INJECT_FAULT": "swap_block_tables:0.5,inflate_computed:0.5"})
    first, second = WorkerFaults(settings), WorkerFaults(settings)
    draws = [[f.swap_rng.random() for _ in range(3)] + [f.inflate_rng.random()] for f in (first, second)]
    assert draws[0] == draws[1] and draws[0][0] != draws[0][3]
