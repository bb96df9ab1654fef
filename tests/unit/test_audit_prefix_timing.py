"""The prefix-timing probe's verdict from its three times: a hit's speed on another tenant's prefix
fails, a computation's passes, and a server whose own hits do not show cannot be judged."""

from __future__ import annotations

import pytest

from kvfence.audit.prefix_timing import judge


@pytest.mark.parametrize(
    ("cold", "own", "cross", "status"),
    [
        (3.0, 0.07, 0.08, "FAIL"),  # served from the other tenant's cache
        (3.0, 0.07, 0.40, "FAIL"),  # under sqrt(0.07 * 3.0) = 0.46: nearer a hit than a computation
        (3.0, 0.07, 0.50, "PASS"),
        (3.0, 0.07, 3.40, "PASS"),  # computed
        (3.0, 1.60, 0.10, "INCONCLUSIVE"),  # its own hit is not twice as fast: nothing to compare with
    ],
)
def test_the_verdict_follows_where_the_other_tenants_time_falls(
    cold: float, own: float, cross: float, status: str
) -> None:
    result = judge(cold, own, cross)
    assert result.status == status and result.name == "prefix_timing"
    assert f"{cross:.3f} s" in result.details
