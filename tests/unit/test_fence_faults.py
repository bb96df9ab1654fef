"""Every single-node fault, twice: isolation off shows the leak, isolation on aborts exactly the affected
request while the rest of the batch produces its solo tokens, and a normal request succeeds afterwards.
Each runs on the tiny model of every architecture (`arch_tiny`): Gemma's sliding-window layer reads a
subset of what the fence validated, and its global layer still reads the whole context.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
from conftest import make_engine, tiny_model, with_fake_graphs

from kvfence.engine.engine import LLMEngine
from kvfence.engine.trace import PageTrace
from kvfence.model.transformer import Transformer
from kvfence.request import Request, Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import FOREIGN_OWNER, STALE_GENERATION, STALE_WRITE, UNWRITTEN_READ

_rng = random.Random(7)
PROMPTS = {n: [_rng.randrange(256) for _ in range(n)] for n in (5, 7, 9, 10, 12, 14, 18, 20, 56)}


@dataclass(frozen=True)
class Job:
    tenant: str
    prompt_len: int
    max_tokens: int

    def add(self, engine: LLMEngine) -> Request:
        params = SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)
        return engine.add_request(PROMPTS[self.prompt_len], params, self.tenant)


def run_all(engine: LLMEngine, requests: list[Request]) -> None:
    while not all(r.is_finished for r in requests):
        engine.step()


# Each scenario drives an engine and returns its requests by label.
Scenario = Callable[[LLMEngine], dict[str, Request]]


def read_beyond_written(engine: LLMEngine) -> dict[str, Request]:
    a = Job("a", 56, 8).add(engine)  # fills the whole pool, then frees it: pages keep A's data
    run_all(engine, [a])
    engine.faults.arm("read_beyond_written", times=1)
    reqs = {"b": Job("b", 14, 6).add(engine), "c": Job("c", 9, 6).add(engine)}
    run_all(engine, list(reqs.values()))
    return reqs


def double_allocation(engine: LLMEngine) -> dict[str, Request]:
    reqs = {"b": Job("b", 10, 10).add(engine), "c": Job("c", 7, 10).add(engine)}
    engine.step()
    engine.faults.arm("double_allocation", times=1)  # D's first page is one B still holds
    reqs["d"] = Job("a", 12, 4).add(engine)
    run_all(engine, list(reqs.values()))
    return reqs


def stale_mapping(engine: LLMEngine) -> dict[str, Request]:
    engine.faults.arm("stale_mapping", times=1)  # X's release also frees a page C still maps
    reqs = {
        "b": Job("b", 10, 10).add(engine),
        "c": Job("c", 7, 10).add(engine),
        "x": Job("c", 5, 1).add(engine),
    }
    engine.step()
    assert reqs["x"].is_finished
    reqs["d"] = Job("a", 12, 4).add(engine)  # D is handed the freed page and writes its prompt into it
    run_all(engine, list(reqs.values()))
    return reqs


def cross_tenant_prefix_hit(engine: LLMEngine) -> dict[str, Request]:
    a = Job("a", 20, 4).add(engine)  # A's full pages stay in the prefix cache
    run_all(engine, [a])
    engine.faults.arm("cross_tenant_prefix_hit", times=1)
    reqs = {"b": Job("b", 18, 8).add(engine), "c": Job("c", 9, 8).add(engine)}
    run_all(engine, list(reqs.values()))
    return reqs


def stale_write(engine: LLMEngine) -> dict[str, Request]:
    reqs = {"b": Job("b", 10, 8).add(engine), "c": Job("c", 7, 8).add(engine)}
    engine.step()
    engine.faults.arm("stale_write", times=1)  # B's next KV write goes to C's page under a stale generation
    run_all(engine, list(reqs.values()))
    return reqs


@dataclass(frozen=True)
class Case:
    scenario: Scenario
    engine_settings: dict[str, object]
    aborted: str  # the request the fence must abort
    leaked_into: str  # the request whose output the bug corrupts when the fence is off
    reason: str


CASES = {
    "read_beyond_written": Case(
        read_beyond_written,
        {"num_pages": 16, "max_model_len": 64, "enable_prefix_caching": False},
        "b",
        "b",
        UNWRITTEN_READ,
    ),
    "double_allocation": Case(double_allocation, {"num_pages": 32}, "b", "b", STALE_GENERATION),
    "stale_mapping": Case(stale_mapping, {"num_pages": 32}, "c", "c", STALE_GENERATION),
    "cross_tenant_prefix_hit": Case(cross_tenant_prefix_hit, {"num_pages": 32}, "b", "b", FOREIGN_OWNER),
    "stale_write": Case(stale_write, {"num_pages": 32}, "b", "c", STALE_WRITE),
}


def solo(model: Transformer, request: Request, settings: dict[str, object]) -> list[int]:
    engine = make_engine(model, **settings)
    return engine.generate([request.prompt_token_ids], request.params, request.tenant)[0].output_token_ids


def run_case(
    model: Transformer, case: Case, isolation: bool, graphs: bool = False
) -> tuple[LLMEngine, dict[str, Request], PageTrace]:
    """The case's scenario on a fresh engine; `graphs`: its decode steps through the graph runner (a fake
    capture), as on CUDA, where the fence must stand before a replay as before an eager forward."""
    engine = make_engine(model, isolation=isolation, decode_graphs=graphs, **case.engine_settings)
    fake = with_fake_graphs(engine) if graphs else None
    trace = PageTrace(engine.pool)
    engine.runner.observer = trace
    requests = case.scenario(engine)
    assert fake is None or fake.replays, "no decode step went through the graph runner"
    return engine, requests, trace


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("fault", sorted(CASES))
def test_fault_leaks_with_isolation_off(arch_tiny: Transformer, fault: str, graphs: bool) -> None:
    case = CASES[fault]
    engine, reqs, trace = run_case(arch_tiny, case, isolation=False, graphs=graphs)
    assert engine.faults.fired == {fault: 1}
    assert all(r.status is Status.FINISHED for r in reqs.values()), "nothing is aborted without the fence"
    victim = reqs[case.leaked_into]
    assert victim.output_token_ids != solo(arch_tiny, victim, case.engine_settings), (
        "the bug changed no output"
    )
    culprit = reqs[case.aborted]
    foreign = (
        trace.foreign_writes(culprit.request_id)
        if fault == "stale_write"
        else trace.foreign_reads(victim.request_id)
    )
    assert foreign, "the page trace shows no foreign page"


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("fault", sorted(CASES))
def test_fault_is_caught_with_isolation_on(arch_tiny: Transformer, fault: str, graphs: bool) -> None:
    case = CASES[fault]
    engine, reqs, trace = run_case(arch_tiny, case, isolation=True, graphs=graphs)
    assert engine.faults.fired == {fault: 1}
    aborted = reqs[case.aborted]
    assert aborted.status is Status.ABORTED and aborted.finish_reason == case.reason
    assert engine.events.kinds(aborted.request_id)[-2:] == ["aborted", "released"]
    assert engine.integrity_aborts == {case.reason: 1}
    for label, request in reqs.items():
        assert trace.foreign_reads(request.request_id) == [], f"{label} read a foreign page"
        assert trace.foreign_writes(request.request_id) == [], f"{label} wrote a foreign page"
        if label != case.aborted:
            assert request.status is Status.FINISHED
            assert request.output_token_ids == solo(arch_tiny, request, case.engine_settings), (
                f"{label} changed"
            )
    after = Job("z", 9, 6).add(engine)
    run_all(engine, [after])
    assert after.status is Status.FINISHED
    assert after.output_token_ids == solo(arch_tiny, after, case.engine_settings)


def test_clean_batch_reads_only_own_pages(arch_tiny: Transformer) -> None:
    """The baseline the fault tests compare against: no fault, no foreign access, no abort."""
    engine = make_engine(arch_tiny, num_pages=32)
    trace = PageTrace(engine.pool)
    engine.runner.observer = trace
    reqs = [Job(t, n, 8).add(engine) for t, n in (("a", 20), ("b", 12), ("a", 20), ("c", 5))]
    run_all(engine, reqs)
    assert all(r.status is Status.FINISHED for r in reqs)
    assert all(trace.reads[r.request_id] for r in reqs)
    assert not any(trace.foreign_reads(r.request_id) or trace.foreign_writes(r.request_id) for r in reqs)
    assert engine.fence.stats.checks == engine.num_steps and not engine.integrity_aborts


@pytest.mark.parametrize("fault", sorted(CASES))
def test_over_a_float16_pool_each_fault_leaks_without_the_fence_and_aborts_with_it(fault: str) -> None:
    """The fence checks pages, not their values: over a float16 pool (`--kv-cache-dtype float16`, the C
    layer writing and the C kernel reading it) each fault changes an output with isolation off and aborts
    exactly its request with isolation on, the others keeping their solo tokens."""
    model = tiny_model(decode_matmul="kernel")  # packed weights: every layer in C
    case = replace(
        CASES[fault], engine_settings={**CASES[fault].engine_settings, "kv_cache_dtype": "float16"}
    )
    engine, reqs, _ = run_case(model, case, isolation=False)
    victim = reqs[case.leaked_into]
    assert engine.pool.kv.dtype.itemsize == 2 and engine.faults.fired == {fault: 1}
    assert victim.output_token_ids != solo(model, victim, case.engine_settings), "the bug changed no output"
    engine, reqs, _ = run_case(model, case, isolation=True)
    assert reqs[case.aborted].status is Status.ABORTED and reqs[case.aborted].finish_reason == case.reason
    for label, request in reqs.items():
        if label != case.aborted:
            assert request.output_token_ids == solo(model, request, case.engine_settings), f"{label} changed"
