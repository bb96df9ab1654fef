"""A check's verdict: `CheckResult` (name, PASS/FAIL/SKIP/INCONCLUSIVE, details, evidence) and the helpers
that build one, which the black-box probes (probes.py, canaries.py, replay.py) and the white-box acceptance
checks (pinned.py, checks.py) all return.

INCONCLUSIVE is not a failure (it leaves `passed` None, as SKIP does, so the overall verdict and the exit
code do not count it) but it is not a pass either: the check ran and could not conclude, and says why.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

INCONCLUSIVE = "INCONCLUSIVE"


@dataclass
class CheckResult:
    """One probe's or check's verdict. `passed` None: not run (SKIP) or, with `inconclusive`, run without
    a conclusion (INCONCLUSIVE); the reason is in `details`."""

    name: str
    passed: bool | None
    details: str
    evidence: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # requests to draw timelines for
    inconclusive: bool = False

    @property
    def status(self) -> str:
        if self.passed is None:
            return INCONCLUSIVE if self.inconclusive else "SKIP"
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def verdict(name: str, problems: list[dict[str, Any]], ok: str, request_ids: list[str]) -> CheckResult:
    """PASS with `ok` when there are no problems; else FAIL naming the first one (all are evidence)."""
    if not problems:
        return CheckResult(name, True, ok, [], request_ids)
    first = problems[0].get("problem", "")
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckResult(name, False, f"{first}{more}", problems, request_ids)


def inconclusive(
    name: str,
    details: str,
    evidence: list[dict[str, Any]] | None = None,
    request_ids: list[str] | None = None,
) -> CheckResult:
    """INCONCLUSIVE: the check ran but its evidence cannot decide (`details` says why)."""
    return CheckResult(name, None, details, evidence or [], request_ids or [], inconclusive=True)
