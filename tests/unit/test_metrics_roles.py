"""vLLM's series keep kvfence's per-pool `role` label: a disaggregated router's stats (a prefill and a decode
pool, and the router's own dropped frames without a pool) give one series per pool, each with the served
model's name, and none for the router. The engine's preemptions and tokens per step, under kvfence's names
and vLLM's, follow from the requests served."""

from __future__ import annotations

from conftest import make_engine
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfence.api.metrics import Metrics
from kvfence.engine.engine import LLMEngine
from kvfence.engine.iteration import ITERATION_BUCKETS
from kvfence.engine.stats import EngineStats
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams


class DisaggregatedStats:
    """The part of an EngineClient that /metrics reads, shaped as disagg.router.Router.stats answers."""

    def stats(self) -> dict[str, EngineStats]:
        def pool(held: int, running: int, waiting: int) -> EngineStats:
            stats = EngineStats(100, 100 - held, {"free": 100 - held}, 0, {}, 0, 0, 0.0)
            return EngineStats.from_dict({**stats.to_dict(), "num_running": running, "num_waiting": waiting})

        return {"prefill": pool(10, 1, 3), "decode": pool(40, 2, 0), "router": EngineStats.transport_only({})}


def test_vllm_series_are_per_pool_role_with_the_model_name() -> None:
    metrics = Metrics(DisaggregatedStats(), "m")  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    series = {
        (s.name, s.labels.get("role")): (s.labels.get("model_name"), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith(("kvfence_num_requests", "kvfence_kv_cache_usage"))
    }
    assert series == {
        ("kvfence_num_requests_running", "prefill"): ("m", 1),
        ("kvfence_num_requests_running", "decode"): ("m", 2),
        ("kvfence_num_requests_waiting", "prefill"): ("m", 3),
        ("kvfence_num_requests_waiting", "decode"): ("m", 0),
        ("kvfence_kv_cache_usage_ratio", "prefill"): ("m", 0.1),
        ("kvfence_kv_cache_usage_ratio", "decode"): ("m", 0.4),
    }
    assert 'kvfence_e2e_request_latency_seconds_count{model_name="m"} 0.0' in text


def scrape(text: str) -> dict[str, float]:
    """Every sample of vLLM's names, by its name and its `le` (histogram buckets), summed over roles."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (f"[{s.labels['le']}]" if "le" in s.labels else "")
            found[key] = found.get(key, 0.0) + s.value
    return found


def test_preemptions_and_iteration_tokens_follow_from_the_requests_served(tiny: Transformer) -> None:
    engine = make_engine(tiny, num_pages=12)  # 48 tokens: one request at a time fits, six do not
    metrics = Metrics(SingleNode(engine), "m", compat="vllm")  # type: ignore[arg-type]
    before = scrape(metrics.exposition().decode())
    assert before["vllm:num_preemptions_total"] == 0 and before["vllm:iteration_tokens_total_count"] == 0
    prompts = [[(7 * n + i) % 250 + 1 for i in range(n)] for n in (30, 25, 18, 33, 7, 21)]
    requests = engine.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    preempted = sum(r.num_preemptions for r in requests)
    assert preempted > 0
    after = scrape(metrics.exposition().decode())
    assert after["vllm:num_preemptions_total"] == after["kvfence_num_preemptions_total"] == preempted
    assert after["vllm:iteration_tokens_total_count"] == engine.num_steps
    assert after["vllm:iteration_tokens_total_bucket[+Inf]"] == engine.num_steps
    # Every step's tokens: each prompt token computed (a preempted request's again, less what it finds of
    # its own pages in the prefix cache) and each generated token, once.
    generated = sum(len(r.output_token_ids) for r in requests)
    assert after["vllm:iteration_tokens_total_sum"] == engine.prompt_tokens_computed + generated
    assert engine.prompt_tokens_computed > 0
    buckets = [after[f"vllm:iteration_tokens_total_bucket[{float(b)}]"] for b in ITERATION_BUCKETS]
    assert buckets == sorted(buckets) and buckets[0] >= 1  # cumulative; decode steps of one token
    assert after["kvfence_iteration_tokens_sum"] == after["vllm:iteration_tokens_total_sum"]


def test_iteration_tokens_without_preemption_are_prompt_plus_generated(tiny: Transformer) -> None:
    engine = make_engine(tiny)
    prompts = [[(5 * n + i) % 250 + 1 for i in range(n)] for n in (9, 14, 22)]
    requests = engine.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    stats = EngineStats.read(engine)
    assert stats.num_preemptions == 0
    generated = sum(len(r.output_token_ids) for r in requests)
    assert stats.iteration_tokens_sum == sum(map(len, prompts)) + generated  # distinct prompts: no cache hit
    assert sum(stats.iteration_tokens) == engine.num_steps


class SingleNode:
    """The part of an EngineClient that /metrics reads, over an engine stepped on this thread."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine

    def stats(self) -> dict[str, EngineStats]:
        return {"single": EngineStats.read(self.engine)}
