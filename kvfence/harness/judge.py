"""The rules a load run must meet, and its report: what tests assert and bench/stress.py prints.

`RunReport.problems` lists every rule broken, human readable; an empty list is a pass:
  - every completed request equals its solo reference (a divergence only at a near-tie: references.py);
  - every other request ended with a clear error (400 context_length_exceeded for a job beyond the window,
    500 kv_integrity_error, 503 retry-later) or the client's own cancellation: never an error, a timeout,
    or a job skipped for lack of time;
  - no tenant's canary in any text another tenant received;
  - every fault that took effect was caught or absorbed (none missed, none unresolved: ledger.py);
  - after the drain every page is free or cached with no reference, nothing quarantined, no live request,
    the allocator consistent, /metrics agreeing;
  - /health answered throughout.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from kvfence.harness.ledger import FaultLedger
from kvfence.harness.load import Health, Job, Outcome, Tenant
from kvfence.harness.references import Reference, compare
from kvfence.harness.tables import print_table
from kvfence.model.tokenizer import Tokenizer

OUTCOME_KINDS = (
    "completed",
    "rejected",
    "integrity",
    "retry_later",
    "cancelled",
    "error",
    "timeout",
    "skipped",
)


@dataclass
class RunReport:
    mode: str
    wall_s: float
    outcomes: list[Outcome]
    health: Health
    drain: dict[str, Any] = field(default_factory=dict)  # pool state after the load
    faults: dict[str, Any] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)  # "job N (tenant-x) shows tenant-y's canary"
    problems: list[str] = field(default_factory=list)  # failed checks, human readable

    def counts(self) -> Counter[str]:
        return Counter(o.kind for o in self.outcomes)


def judge_outcomes(
    jobs: list[Job], outcomes: list[Outcome], refs: dict[int, Reference], tok: Tokenizer
) -> list[str]:
    """Fill `match` on completed outcomes; return every outcome that breaks a rule."""
    problems = []
    for outcome in outcomes:
        job = jobs[outcome.job]
        if outcome.kind == "completed":
            if job.must_reject:
                problems.append(f"job {job.index} ({job.shape}) completed but exceeds the window")
                continue
            outcome.match = compare(refs[job.index], outcome.text, tok)
            if outcome.match == "differs":
                problems.append(f"job {job.index} ({job.shape}) completed with output != its reference")
        elif outcome.kind == "rejected":
            if not job.must_reject or outcome.error_code != "context_length_exceeded":
                problems.append(f"job {job.index} ({job.shape}) refused: {outcome.error_code}")
        elif outcome.kind == "retry_later" and outcome.status != 503:
            problems.append(f"job {job.index}: {outcome.error_code} answered {outcome.status}, not 503")
        elif outcome.kind in ("error", "timeout", "skipped"):
            problems.append(
                f"job {job.index} ({job.shape}): {outcome.kind} {outcome.status} {outcome.error_code}"
            )
        elif job.must_reject:
            problems.append(f"job {job.index} ({job.shape}) exceeds the window but ended {outcome.kind}")
    return problems


def canary_leaks(jobs: list[Job], outcomes: list[Outcome], tenants: list[Tenant]) -> list[str]:
    """Any other tenant's canary in any text a client received (completed, cancelled or cut off)."""
    leaks = []
    for outcome in outcomes:
        owner = jobs[outcome.job].tenant
        for tenant in tenants:
            if tenant != owner and tenant.canary in outcome.text:
                leaks.append(f"job {outcome.job} ({owner.name}) received {tenant.name}'s canary")
    return leaks


def received_ok_by_request(
    outcomes: list[Outcome], refs: dict[int, Reference]
) -> Callable[[str], bool | None]:
    """request id -> True when what its client received is its reference output (near ties allowed) or, for
    a client that hung up, the start of it; False when a completed output differs; None when nothing can be
    judged (no answer, or a hang-up whose text is not the start of its reference: a near tie may explain it).
    A hang-up's request may finish in the engine before the disconnect reaches it: its record then shows no
    abort, and only the text its client received can tell whether anything wrong was read."""
    by_id = {o.request_id: o for o in outcomes if o.request_id}

    def received_ok(request_id: str) -> bool | None:
        outcome = by_id.get(request_id)
        if outcome is not None and outcome.kind == "completed":
            return outcome.match in ("exact", "near_tie")
        if outcome is not None and outcome.kind == "cancelled" and outcome.job in refs:
            return True if refs[outcome.job].text.startswith(outcome.text) else None
        return None

    return received_ok


def drain_problems(drain: dict[str, Any]) -> list[str]:
    problems = [] if drain.get("integrity", "ok") == "ok" else [f"allocator integrity: {drain['integrity']}"]
    for key in ("referenced_pages", "quarantined_pages", "owned_uncached_pages", "live_requests"):
        if drain.get(key, 0):
            problems.append(f"after the drain {key} = {drain[key]}")
    if drain.get("pages_free") != drain.get("num_pages"):
        problems.append(f"after the drain pages_free {drain.get('pages_free')} != {drain.get('num_pages')}")
    if drain.get("metrics_pages_free") not in (None, drain.get("num_pages")):
        problems.append(f"/metrics pages_free {drain['metrics_pages_free']} != {drain.get('num_pages')}")
    return problems


def health_problems(health: Health) -> list[str]:
    return [f"/health failed {health.failures} of {health.polls} polls"] if health.failures else []


def fault_summary(ledger: FaultLedger, received_ok: Callable[[str], bool | None]) -> dict[str, Any]:
    """Per fault: how often it fired, took effect, was caught, absorbed, missed."""
    verdicts = ledger.verdicts(received_ok)
    fired = ledger.engine.faults.fired
    table: dict[str, dict[str, int]] = {}
    for name in sorted(set(fired) | {v.fault for v in verdicts}):
        counts = Counter(v.verdict for v in verdicts if v.fault == name)
        table[name] = {"fired": fired.get(name, 0), "effects": sum(counts.values()), **counts}
    return {"by_fault": table, "effects": [asdict(v) for v in verdicts]}


def fault_problems(faults: dict[str, Any]) -> list[str]:
    return [
        f"{name}: {row.get(v, 0)} {v}"
        for name, row in faults.get("by_fault", {}).items()
        for v in ("missed", "unresolved")
        if row.get(v, 0)
    ]


def print_report(report: RunReport) -> None:
    """The run as tables: outcomes by kind, completed vs reference, /health, faults, drain, verdict."""
    counts = report.counts()
    matches = Counter(o.match for o in report.outcomes if o.match)
    print(f"\n== {report.mode}: {len(report.outcomes)} requests in {report.wall_s:.1f}s ==")
    print_table(OUTCOME_KINDS, [[counts.get(k, 0) for k in OUTCOME_KINDS]])
    retries = sum(o.attempts - 1 for o in report.outcomes)
    print(
        f"completed vs reference: {dict(matches)}; canary leaks: {len(report.leaks)}; 503 retries: {retries}"
    )
    health = report.health
    print(f"/health: {health.polls} polls, {health.failures} failed, max {health.max_latency_s:.2f}s")
    by_fault = report.faults.get("by_fault")
    if by_fault:
        columns = ("fired", "effects", "caught", "absorbed", "missed", "unresolved")
        print_table(
            ("fault", *columns), [[name, *(row.get(c, 0) for c in columns)] for name, row in by_fault.items()]
        )
    elif report.faults:
        print(f"faults (from audit trails): {report.faults}")
    print(f"drain: {report.drain}")
    print("PASS" if not report.problems else "FAIL:\n  " + "\n  ".join(report.problems))
