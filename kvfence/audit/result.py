"""A check's verdict: `CheckResult` (name, PASS/FAIL/SKIP, details, evidence) and `verdict`, which the
black-box probes (probes.py) and the white-box acceptance checks (pinned.py, checks.py) all return."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class CheckResult:
    """One probe's or check's verdict. `passed` None: not run (the reason is in `details`)."""

    name: str
    passed: bool | None
    details: str
    evidence: list[dict[str, Any]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # requests to draw timelines for

    @property
    def status(self) -> str:
        return "SKIP" if self.passed is None else "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "status": self.status}


def verdict(name: str, problems: list[dict[str, Any]], ok: str, request_ids: list[str]) -> CheckResult:
    """PASS with `ok` when there are no problems; else FAIL naming the first one (all are evidence)."""
    if not problems:
        return CheckResult(name, True, ok, [], request_ids)
    first = problems[0].get("problem", "")
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return CheckResult(name, False, f"{first}{more}", problems, request_ids)
