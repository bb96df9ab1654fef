"""What bench/disagg.py computes, now in kvfence/harness: the KV transfer rates read from audit trails, the
worker names a `serve --disaggregated` command starts, and CURVE's cost against the plain transport; and
bench/step_rows.py's ceiling for speculation."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.harness.curve_cost import CURVE_COST_TARGET, TransportSummary, compare
from kvfence.harness.served_systems import worker_list
from kvfence.harness.step_rows import ceiling
from kvfence.harness.trail_transfer import transfer_rates

PAGE = 1_000_000  # bytes per page: 1 MB, so MB and GB/s read off the timestamps


def trail(started: float, complete: float, received: list[float]) -> list[dict[str, Any]]:
    events = [
        {"where": "prefill", "kind": "transfer_started", "ts": started},
        {"where": "prefill", "kind": "transfer_complete", "ts": complete},
        {"where": "router", "kind": "page_received", "ts": 99.0},  # not decode's: not counted
    ]
    return events + [{"where": "decode", "kind": "page_received", "ts": ts} for ts in received]


def test_transfer_rates_pool_the_trails() -> None:
    # Request 1: 3 pages, sent in 1 ms, the last received 2 ms after the start, a 1 ms burst (2 pages).
    # Request 2: 2 pages, sent in 1 ms, the last received 4 ms after the start, a 2 ms burst (1 page).
    rates = transfer_rates(
        [trail(0.0, 0.001, [0.001, 0.0015, 0.002]), trail(1.0, 1.001, [1.002, 1.004])], PAGE
    )
    assert rates["requests"] == 2 and rates["pages"] == 5
    assert rates["mb_moved"] == pytest.approx(5.0)
    assert rates["send_gb_per_s"] == pytest.approx(5e6 / 0.002 / 1e9)
    assert rates["end_to_end_gb_per_s"] == pytest.approx(5e6 / 0.006 / 1e9)
    assert rates["end_to_end_gb_per_s_median_request"] == pytest.approx((1.5 + 0.5) / 2)
    assert rates["decode_burst_gb_per_s"] == pytest.approx(3e6 / 0.003 / 1e9)


def test_worker_names_follow_the_serve_arguments() -> None:
    assert worker_list(["--disaggregated"]) == ["prefill", "decode"]
    two_by_two = ["--disaggregated", "--prefill-workers", "2", "--decode-workers", "2"]
    assert worker_list(two_by_two) == ["prefill-0", "prefill-1", "decode-0", "decode-1"]


def summary(transport: str, tok_per_s: float, foreign_cpu: float = 0.0) -> TransportSummary:
    rates = {"send_gb_per_s": 2.0, "end_to_end_gb_per_s": 1.0, "decode_burst_gb_per_s": 4.0}
    return TransportSummary(transport, 2, tok_per_s, 0.1, 0.2, foreign_cpu, rates)


def test_curve_cost_against_its_target() -> None:
    within = compare(summary("CURVE", 95.0), summary("plain", 100.0))
    assert within["curve_cost_pct"] == pytest.approx(5.0) and within["passed"]
    assert not within["contended"]
    over = compare(summary("CURVE", 100.0 * (1 - CURVE_COST_TARGET) - 1), summary("plain", 100.0, 0.5))
    assert not over["passed"] and over["contended"]
    assert over["transfer_gb_per_s_curve_over_plain"] == {"send": 1.0, "end_to_end": 1.0, "decode_burst": 1.0}


def test_speculation_ceiling_follows_the_step_cost() -> None:
    """A step linear in its rows leaves drafts nothing (1.0x whatever k); a step of fixed cost gives every
    kept draft a token (1 + k); a measured mix in between."""
    linear = {16: 0.016, 32: 0.032, 64: 0.064}
    fixed = dict.fromkeys(linear, 0.016)
    assert [ceiling(linear, 16, k) for k in (1, 3)] == pytest.approx([1.0, 1.0])
    assert [ceiling(fixed, 16, k) for k in (1, 3)] == pytest.approx([2.0, 4.0])
    assert ceiling({16: 0.015, 32: 0.025}, 16, 1) == pytest.approx(1.2)
