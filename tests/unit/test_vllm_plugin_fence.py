"""The vLLM plugin's fence logic without vLLM (plugins/vllm, issue 62): tags on blocks, the scheduler's
records and their verdict, the worker's row check, the fault's draw, and the settings' refusals."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvfence.trail.reasons import FOREIGN_OWNER, STALE_GENERATION
from kvfence_vllm.records import SchedulerRecords, StepPlan
from kvfence_vllm.rows import NULL_BLOCK, check_rows, choose_rows, neutralise
from kvfence_vllm.settings import PluginRefused, Settings, check_engine, check_version, from_environ
from kvfence_vllm.tags import BlockTags


def records_with(blocks: int = 32) -> SchedulerRecords:
    return SchedulerRecords(BlockTags(blocks), block_size=16)


def test_fresh_blocks_are_recorded_at_their_generation_and_claimed_by_the_tenant() -> None:
    records = records_with()
    records.tags.handed_out([3, 4, 7])
    plan = records.plan([("a", "tenant-a", [3, 4], 1), ("b", "tenant-b", [7], 1)])
    assert plan.condemned == {}
    assert (
        plan.req_ids == ("a", "b") and plan.starts.tolist() == [0, 2, 3] and plan.pages.tolist() == [3, 4, 7]
    )
    assert records.records["a"].generations == (1, 1)
    assert records.tags.owner[[3, 4, 7]].tolist() == [0, 0, 1]


def test_a_block_freed_and_handed_out_again_under_a_running_request_is_stale_for_it_alone() -> None:
    records = records_with()
    records.tags.handed_out([3, 4, 7])
    records.plan([("a", "t", [3, 4], 1), ("b", "t", [7], 1)])
    records.tags.freed([4])  # a bookkeeping bug: freed while "a" still maps it
    records.tags.handed_out([4])
    plan = records.plan([("a", "t", [3, 4], 1), ("b", "t", [7], 1), ("c", "t", [4], 1)])
    assert plan.condemned == {"a": STALE_GENERATION}


def test_a_prefix_hit_is_clean_for_the_same_tenant_and_foreign_for_another() -> None:
    records = records_with()
    records.tags.handed_out([5, 6])
    records.plan([("a", "tenant-a", [5, 6], 1)])
    records.forget("a")
    records.tags.freed([5, 6])
    records.tags.revived([5])  # a later request hits the cached first block
    assert records.plan([("a2", "tenant-a", [5], 1)]).condemned == {}
    assert records.plan([("x", "tenant-b", [5], 1)]).condemned == {"x": FOREIGN_OWNER}


def test_a_block_nobody_holds_is_foreign() -> None:
    records = records_with()
    records.tags.handed_out([2])
    records.plan([("a", "t", [2], 1)])
    records.tags.freed([2])
    records.forget("a")
    assert records.plan([("b", "t", [2], 1)]).condemned == {"b": FOREIGN_OWNER}


def test_a_preempted_request_is_recorded_afresh_when_it_resumes() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    records.plan([("a", "t", [1, 2], 1)])
    row = records.records["a"].row
    records.forget("a")
    assert "a" not in records.records and records.table.rows_in_use == 0
    records.tags.freed([1, 2])
    records.tags.handed_out([9])
    plan = records.plan([("a", "t", [9], 1)])
    assert plan.condemned == {} and records.records["a"].pages == (9,) and records.records["a"].row == row


def test_growing_records_append_and_a_replaced_entry_rebuilds_the_record() -> None:
    records = records_with()
    records.tags.handed_out([1, 2])
    records.plan([("a", "t", [1], 1)])
    records.plan([("a", "t", [1, 2], 1)])
    assert records.records["a"].pages == (1, 2) and records.rebuilt == 0
    records.tags.handed_out([8])
    records.plan([("a", "t", [1, 8], 1)])
    assert records.records["a"].pages == (1, 8) and records.rebuilt == 1


NOTHING_WRITTEN = np.zeros(4, dtype=np.int64)  # the worker's start per row: fresh requests start at 0


def worker_table(rows: list[list[int]], width: int = 8) -> tuple[np.ndarray, np.ndarray]:
    table = np.zeros((4, width), dtype=np.int32)
    lengths = np.zeros(4, dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
        lengths[i] = len(row)
    return table, lengths


def planned() -> tuple[SchedulerRecords, StepPlan]:
    records = records_with()
    records.tags.handed_out([3, 4, 5, 6, 7])
    return records, records.plan([("a", "t", [3, 4], 1), ("b", "t", [5, 6], 1), ("c", "t", [7], 1)])


def test_rows_equal_to_their_records_pass() -> None:
    _, plan = planned()
    table, lengths = worker_table([[3, 4], [5, 6], [7]])
    assert check_rows(plan, {"a": 0, "b": 1, "c": 2}, table, lengths, NOTHING_WRITTEN) == {}


def test_swapped_rows_condemn_both_requests_and_no_other() -> None:
    _, plan = planned()
    table, lengths = worker_table([[5, 6], [3, 4], [7]])
    assert check_rows(plan, {"a": 0, "b": 1, "c": 2}, table, lengths, NOTHING_WRITTEN) == {
        "a": FOREIGN_OWNER,
        "b": FOREIGN_OWNER,
    }


@pytest.mark.parametrize(
    ("rows", "row_of"),
    [
        ([[3, 4, 9], [5, 6], [7]], {"a": 0, "b": 1, "c": 2}),  # a block its record does not hold
        ([[3], [5, 6], [7]], {"a": 0, "b": 1, "c": 2}),  # a block too few
        ([[3, 6], [5, 6], [7]], {"a": 0, "b": 1, "c": 2}),  # one entry another request's
        ([[5, 6], [7]], {"b": 0, "c": 1}),  # not in the batch at all
    ],
)
def test_any_difference_in_a_row_condemns_that_request_alone(
    rows: list[list[int]], row_of: dict[str, int]
) -> None:
    _, plan = planned()
    table, lengths = worker_table(rows)
    assert check_rows(plan, row_of, table, lengths, NOTHING_WRITTEN) == {"a": FOREIGN_OWNER}


def test_a_neutralised_row_maps_only_the_null_block() -> None:
    table, _ = worker_table([[3, 4], [5, 6]])
    table[1, 5] = 9  # an entry past the row's length, left from an earlier request
    neutralise(table, [1])
    assert table[0, :2].tolist() == [3, 4] and table[1].tolist() == [NULL_BLOCK] * table.shape[1]


def test_a_fault_draws_distinct_candidate_rows_at_its_probability() -> None:
    rng = random.Random(0)
    assert choose_rows(rng, 1.0, [4], 2) is None and choose_rows(rng, 1.0, [4], 1) == [4]
    assert all(choose_rows(rng, 0.0, [0, 1, 2], 2) is None for _ in range(100))
    pairs = [choose_rows(rng, 1.0, [0, 2, 5], 2) for _ in range(50)]
    assert all(p is not None and p[0] != p[1] and set(p) <= {0, 2, 5} for p in pairs)
    assert all(choose_rows(rng, 1.0, [0, 2], 1) in ([0], [2]) for _ in range(50))
    fired = sum(choose_rows(rng, 0.5, [0, 1], 2) is not None for _ in range(2000))
    assert 800 < fired < 1200


def test_settings_default_to_the_fence_on_without_a_fault() -> None:
    assert from_environ({}) == Settings(fence=True, swap_probability=0.0, fault_seed=0)
    got = from_environ({"KVFENCE_FENCE": "off", "KVFENCE_INJECT_FAULT": "swap_block_tables:0.25"})
    assert got == Settings(fence=False, swap_probability=0.25, fault_seed=0)
    both = from_environ({"KVFENCE_INJECT_FAULT": "inflate_computed:0.05,swap_block_tables:0.1"})
    assert both == Settings(fence=True, swap_probability=0.1, fault_seed=0, inflate_probability=0.05)


@pytest.mark.parametrize(
    "env",
    [
        {"KVFENCE_FENCE": "yes"},
        {"KVFENCE_INJECT_FAULT": "swap_block_tables"},
        {"KVFENCE_INJECT_FAULT": "swap_block_tables:1.5"},
        {"KVFENCE_INJECT_FAULT": "drop_pages:0.1"},
        {"KVFENCE_INJECT_FAULT": "inflate_computed:0.1,inflate_computed:0.2"},
        {"KVFENCE_INJECT_FAULT": "swap_block_tables:0.1,"},
        {"KVFENCE_FAULT_SEED": "-1"},
    ],
)
def test_malformed_settings_are_refused_in_one_line_naming_the_variable(env: dict[str, str]) -> None:
    with pytest.raises(PluginRefused) as refused:
        from_environ(env)
    message = str(refused.value)
    assert "\n" not in message and next(iter(env)) in message


def test_only_the_supported_vllm_versions_pass() -> None:
    check_version("0.32.0")
    check_version("0.32.1+cpu")
    for other in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(PluginRefused, match=f"not {other}"):
            check_version(other)


@pytest.mark.parametrize(
    ("groups", "flags", "named"),
    [
        (["FullAttentionSpec", "SlidingWindowSpec"], (False, False, False), "one full-attention"),
        (["MambaSpec"], (False, False, False), "one full-attention"),
        (["FullAttentionSpec"], (True, False, False), "async scheduling"),
        (["FullAttentionSpec"], (False, True, False), "pipeline parallelism"),
        (["FullAttentionSpec"], (False, False, True), "a KV connector"),
    ],
)
def test_engines_the_written_lengths_cannot_follow_are_refused_naming_why(
    groups: list[str], flags: tuple[bool, bool, bool], named: str
) -> None:
    check_engine(["FullAttentionSpec"], False, False, False)
    with pytest.raises(PluginRefused, match=named) as refused:
        check_engine(groups, *flags)
    assert "\n" not in str(refused.value)
