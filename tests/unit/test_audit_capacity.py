"""The audit's capacity check (kvfence.audit.checks.check_capacity) compares each pool alone with the
window, never the pools summed: the incident deployment (16-page prefill, 128-page decode, 16-token pages,
2,048-token window) held 2,304 tokens in all but only a 256-token prompt, and must FAIL naming the prefill
pool. Fed dicts shaped like GET /v1/audit/info (or /metrics samples): no server needed."""

from __future__ import annotations

from typing import Any

import pytest

from kvfence.audit.checks import check_capacity
from kvfence.audit.probes import Boundary
from kvfence.audit.trail import PoolState, pool_state

PAGE_SIZE = 16
WINDOW = 2048
INCIDENT = {"prefill": 16, "decode": 128}  # pages per pool: 256 and 2048 tokens
# The server answers the whole window and refuses one token more: the router checked only the window.
BOUNDARY = Boundary(
    max_tokens=16, reps_accepted=500, reps_refused=501, accepted_total=WINDOW, refused_total=WINDOW + 1
)


def audit_info(pages: dict[str, int]) -> dict[str, Any]:
    """GET /v1/audit/info of a server with these pools (name -> pages) and the 2,048-token window."""
    pools = {
        name: {
            "page_size": PAGE_SIZE,
            "num_pages": n,
            "capacity_tokens": n * PAGE_SIZE,
            "max_model_len": WINDOW,
        }
        for name, n in pages.items()
    }
    mode = "single" if list(pages) == ["single"] else "disaggregated"
    return {"mode": mode, "max_model_len": WINDOW, "pools": pools}


def drained(pages: dict[str, int]) -> PoolState:
    """/metrics after the audit: every page of every pool free."""
    total = sum(pages.values())
    return PoolState(total, total, 0, 0.0, dict(pages))


def capacity(pages: dict[str, int], advertised: int | None = WINDOW) -> tuple[str, str]:
    result = check_capacity(audit_info(pages), drained(pages), BOUNDARY, advertised, PAGE_SIZE)
    return result.status, result.details


@pytest.mark.parametrize("advertised", [WINDOW, None], ids=["advertised", "measured"])
def test_the_incident_deployment_fails_naming_the_prefill_pool(advertised: int | None) -> None:
    status, details = capacity(INCIDENT, advertised)
    assert status == "FAIL", details
    source = "advertised" if advertised else "measured"
    assert details.startswith(
        f"pool prefill holds 256 tokens (16 pages x 16) but the {source} window is 2048"
    )
    assert "decode" not in details and "more)" not in details  # the decode pool holds the window


@pytest.mark.parametrize(
    "pages",
    [{"single": 128}, {"prefill": 128, "decode": 128}, {"prefill-0": 200, "prefill-1": 128, "decode-0": 130}],
    ids=["single", "prefill+decode", "per-worker"],
)
def test_pools_that_each_hold_the_window_pass(pages: dict[str, int]) -> None:
    status, details = capacity(pages)
    assert status == "PASS", details


def test_one_worker_pool_too_small_fails_naming_it() -> None:
    status, details = capacity({"prefill-0": 128, "prefill-1": 100, "decode-0": 128})
    assert status == "FAIL", details
    assert details.startswith(
        "pool prefill-1 holds 1600 tokens (100 pages x 16) but the advertised window is 2048"
    )
    assert "prefill-0" not in details and "decode-0" not in details


def test_without_audit_info_each_metrics_role_is_a_pool() -> None:
    """A server without /v1/audit/info: pages per `role` on /metrics x the auditor's page size."""
    metrics = {
        "kvfence_pages": [
            ({"role": "prefill", "state": "free"}, 10.0),
            ({"role": "prefill", "state": "owned"}, 6.0),
            ({"role": "decode", "state": "free"}, 128.0),
        ]
    }
    pool = pool_state(metrics)
    assert pool.pages_by_pool == INCIDENT and pool.total_pages == 144
    result = check_capacity(None, pool, BOUNDARY, WINDOW, PAGE_SIZE)
    assert result.status == "FAIL" and result.details.startswith("pool prefill holds 256 tokens"), (
        result.details
    )
