"""The dashboards find their data: every expression of the shipped Grafana dashboard
(dashboards/grafana.json), and every series vLLM's own dashboard reads (with `--metrics-compat vllm`),
matched against a real scrape after traffic: metric name, `model_name`, and each label the expression
groups by; and the dashboard's `replica` variable against a Ray fleet's /metrics (every replica's series
labelled with it)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from starlette.testclient import TestClient
from test_grammar import tiny_engine, tiny_tokenizer

from kvfence.api.server import build_app
from kvfence.engine.async_engine import AsyncEngine
from kvfence.harness.dashboard import expressions, selectors, unanswered
from kvfence.ray.fleet_views import labelled_metrics

DASHBOARD = Path(__file__).parents[2] / "dashboards" / "grafana.json"
MODEL = "tiny-dash"
# The series vLLM's examples/online_serving/prometheus_grafana/grafana.json reads, each selected by
# model_name; its finish-reason panel groups by finished_reason, its heatmaps and quantiles by le.
VLLM_DASHBOARD = [
    ("vllm:e2e_request_latency_seconds_bucket", "le"),
    ("vllm:e2e_request_latency_seconds_sum", None),
    ("vllm:e2e_request_latency_seconds_count", None),
    ("vllm:prompt_tokens_total", None),
    ("vllm:generation_tokens_total", None),
    ("vllm:time_per_output_token_seconds_bucket", "le"),
    ("vllm:time_per_output_token_seconds_sum", None),
    ("vllm:num_requests_running", None),
    ("vllm:num_requests_waiting", None),
    ("vllm:time_to_first_token_seconds_bucket", "le"),
    ("vllm:time_to_first_token_seconds_count", None),
    ("vllm:gpu_cache_usage_perc", None),
    ("vllm:request_prompt_tokens_bucket", "le"),
    ("vllm:request_generation_tokens_bucket", "le"),
    ("vllm:request_success_total", "finished_reason"),
    ("vllm:request_queue_time_seconds_sum", None),
    ("vllm:request_prefill_time_seconds_sum", None),
    ("vllm:request_decode_time_seconds_sum", None),
    ("vllm:request_max_num_generation_tokens_sum", None),
]


@pytest.fixture(scope="module")
def scrape() -> Iterator[str]:
    """/metrics after traffic: requests that end by length and by a stop string, one of them n=2."""
    app = build_app(AsyncEngine(tiny_engine(tiny_tokenizer())), MODEL, None, None, metrics_compat="vllm")
    with TestClient(app) as client:
        body = {"model": MODEL, "prompt": [1, 2, 3, 4, 5], "max_tokens": 6}
        first = client.post("/v1/completions", json=body | {"logprobs": 0}).json()["choices"][0]
        assert first["finish_reason"] == "length"
        client.post("/v1/completions", json=body | {"n": 2, "temperature": 1.0, "seed": 1})
        stop = next(text for text in first["logprobs"]["tokens"][1:] if text)  # a later token's text
        stopped = client.post("/v1/completions", json=body | {"stop": [stop]}).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        yield client.get("/metrics").text


def test_every_expression_of_the_shipped_dashboard_has_data(scrape: str) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    found = expressions(dashboard, {"model_name": MODEL, "replica": ".*"})  # Grafana's All: one server
    assert len(found) >= 25
    missing = {expr: gaps for expr in found if (gaps := unanswered(expr, scrape))}
    assert not missing, missing


def test_the_replica_variable_picks_one_replica_of_a_fleet(scrape: str) -> None:
    """Every selector of the dashboard carries `replica=~"$replica"`: on a fleet's /metrics (two replicas'
    series, each labelled `replica` as kvfence.ray.fleet_views labels them) a replica that is there has
    data in every panel, one that is not has none, and All has data."""
    dashboard = json.loads(DASHBOARD.read_text())
    every = [s for expr in expressions(dashboard, {}) for s in selectors(expr)]
    assert every and all(("replica", "$replica") in s.regexes for s in every), every
    fleet = labelled_metrics({"r0": scrape, "r1": scrape}).decode()
    for replica, has_data in (("r1", True), ("r0|r1", True), (".*", True), ("r9", False)):
        found = expressions(dashboard, {"model_name": MODEL, "replica": replica})
        gaps = [expr for expr in found if unanswered(expr, fleet)]
        assert (not gaps) if has_data else len(gaps) == len(found), (replica, gaps)


def test_vllms_dashboard_reads_kvfence_with_metrics_compat(scrape: str) -> None:
    for metric, by in VLLM_DASHBOARD:
        grouped = f"sum by({by}) " if by else ""
        expr = f'{grouped}(rate({metric}{{model_name="{MODEL}"}}[1m]))'
        assert not unanswered(expr, scrape), expr
    reasons = [line for line in scrape.splitlines() if line.startswith("vllm:request_success_total{")]
    assert {'finished_reason="length"' in line for line in reasons} == {True, False}  # length and stop


def test_a_missing_series_or_label_is_named(scrape: str) -> None:
    """The checker itself fails where data is missing (a name nobody exports; a label a series lacks)."""
    assert unanswered('rate(kvfence_nothing_total{model_name="tiny-dash"}[1m])', scrape) == [
        'kvfence_nothing_total{model_name="tiny-dash"}'
    ]
    assert unanswered("sum by(tenant) (kvfence_prompt_tokens_total)", scrape)
    assert unanswered('kvfence_prompt_tokens_total{model_name="other"}', scrape)
