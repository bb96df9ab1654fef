"""vLLM's series keep kvfence's per-pool `role` label: a disaggregated router's stats (a prefill and a decode
pool, and the router's own dropped frames without a pool) give one series per pool, each with the served
model's name, and none for the router."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvfence.api.metrics import Metrics
from kvfence.engine.stats import EngineStats


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
