"""Load with faults through the real server, short: bench/stress.py's runs and rules on a smaller load.

Single node: 12 clients of 4 tenants, 48 requests of mixed lengths (page edges, exactly at the window,
just beyond it), 20% hung up mid-stream, single-node faults armed at random. Disaggregated: a smaller run
through the Router in front of 2 prefill x 2 decode worker processes (KV moved by NIXL where installed),
with transfer faults on the prefill workers and page faults in the decode workers.
Each run must show: completed requests equal to their offline references, a clear error for every other
request, no canary of one tenant in another's output, every fault effect caught (single node), a clean
pool after the drain, and /health answering throughout (RunReport.problems: kvfence/harness/judge.py).
"""

from __future__ import annotations

import random

import pytest
from conftest import make_engine

from kvfence.harness.judge import RunReport, print_report, received_ok_by_request
from kvfence.harness.load import Outcome
from kvfence.harness.references import Reference
from kvfence.harness.runs import FAULT_RATES, Plan, run_disaggregated, run_single_node
from kvfence.model.gguf import GGUFModel
from kvfence.model.transformer import Transformer
from kvfence.request import Status
from kvfence.sampling import SamplingParams


def _caught(report: RunReport) -> int:
    return sum(row.get("caught", 0) for row in report.faults["by_fault"].values())


@pytest.mark.real_model
def test_single_node_load_with_faults(smollm2: GGUFModel, one_torch_thread: None) -> None:
    plan = Plan(
        clients=12,
        requests=48,
        tenants=4,
        window=256,
        num_pages=48,  # 768 tokens for 12 clients: preemption happens
        max_tokens=8,
        cancel_rate=0.2,
        fault_scale=3.0,
        time_limit_s=60.0,
        seed=0,
    )
    report = run_single_node(smollm2, plan, rates=FAULT_RATES)
    print_report(report)
    assert report.problems == []
    counts = report.counts()
    assert counts["completed"] >= 10 and counts["cancelled"] >= 1 and counts["rejected"] >= 1, counts
    assert _caught(report) >= 1, report.faults["by_fault"]


@pytest.mark.real_model
def test_disaggregated_load_with_faults(smollm2: GGUFModel, one_torch_thread: None) -> None:
    plan = Plan(
        clients=8,
        requests=20,
        tenants=4,
        window=256,
        num_pages=128,  # room for every client's window on decode: no 503 server_busy
        max_tokens=8,
        cancel_rate=0.2,
        fault_scale=2.0,
        time_limit_s=60.0,
        seed=1,
    )
    report = run_disaggregated(smollm2, plan, workers=(2, 2))
    print_report(report)
    assert report.problems == []
    assert report.counts()["completed"] >= 5, report.counts()
    assert report.drain["num_pages"] == 4 * plan.num_pages  # four pools, each drained


def test_double_allocation_of_a_cached_page_leaves_no_stale_prefix_entry(tiny: Transformer) -> None:
    """R2 shares R1's cached prompt pages; double_allocation hands one of them to R3 (R2 is aborted, as it
    must be). R3's KV then sits in a page the prefix index still lists under R1's prompt: R4, same tenant
    and prompt as R1, must not be served from it."""
    rng = random.Random(1)
    prompt, other = [rng.randrange(256) for _ in range(12)], [rng.randrange(256) for _ in range(10)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    solo = make_engine(tiny).generate([prompt], params)[0].output_token_ids
    engine = make_engine(tiny, num_pages=32)
    engine.generate([prompt], params, "a")
    r2 = engine.add_request([*prompt, 1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), "a")
    engine.step()
    engine.faults.arm("double_allocation", times=1)
    r3 = engine.add_request(other, params, "a")
    while not (r2.is_finished and r3.is_finished):
        engine.step()
    assert r2.finish_reason == "stale_generation" and r3.status is Status.FINISHED
    r4 = engine.generate([prompt], params, "a")[0]
    assert r4.output_token_ids == solo, "R4 was served another request's KV from the prefix cache"


def test_a_hang_up_is_judged_by_the_text_its_client_received() -> None:
    """A client that hung up received the start of its reference: nothing wrong was read (True); any other
    text cannot be judged (None), nor can a request nobody answered; a completion is judged whole."""
    refs = {0: Reference([1, 2, 3], "one two three", [9.0, 9.0, 9.0])}
    outcomes = [
        Outcome(0, "cancelled", 200, "start", "one two"),
        Outcome(0, "cancelled", 200, "other", "one three"),
        Outcome(0, "completed", 200, "whole", "one two three", match="exact"),
        Outcome(0, "completed", 200, "wrong", "one two four", match="differs"),
        Outcome(0, "integrity", 500, "aborted"),
    ]
    received_ok = received_ok_by_request(outcomes, refs)
    assert [received_ok(o.request_id or "") for o in outcomes] == [True, None, True, False, None]
    assert received_ok("never-answered") is None
