"""Acceptance checks 2 to 5 and tenant_pages, white-box: read from the probe requests' audit trails
(`GET /v1/audit/requests/{id}`) and the pool on /metrics (check 1, pinned_versions, is pinned.py).

2. capacity               each pool alone (pages x page size, from /v1/audit/info, else /metrics) vs the
                          advertised window and the one the boundary probe measured: every pool must
                          hold the window, never the pools summed, and the two windows must agree;
3. rejection_terminates   inside/at the boundary answered; beyond it refused with a 4xx whose trail holds
                          `rejected` and no allocation, transfer, read or step event;
4. complete_handoff       a request whose KV was not complete (a fault fired, an integrity abort) ends in an
                          error with no content, its trail `aborted` with an integrity reason, never
                          `finished`; a 200 has a finished trail whose every step was fence-validated and
                          (disaggregated) whose decode started only after `transfer_complete`;
5. recycle_timing         a dropped stream's trail runs aborted -> (quarantined -> drained ->) released,
                          nothing runs or lands after the abort, no page is allocated to another request
                          while a request still holds it, the pool drains back to all-free, and a normal
                          request succeeds afterwards;
tenant_pages              no request reads a page another tenant wrote (pages_read) or shares a cached page
                          last allocated to another tenant (prefix_hit).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvfence.audit.client import Exchange
from kvfence.audit.probes import Boundary
from kvfence.audit.result import CheckResult, verdict
from kvfence.audit.trail import (
    ACQUIRE,
    Event,
    PoolState,
    Trail,
    by_where,
    event_pages,
    final_finishes,
    held_pages,
    tenant_of,
    where,
)
from kvfence.trail.reasons import INTEGRITY_REASONS

FORBIDDEN_AFTER_REJECTION = frozenset(
    {
        "pages_allocated",
        "prefix_hit",
        "transfer_started",
        "page_received",
        "transfer_complete",
        "validated",
        "step",
        "pages_read",
    }
)
FORBIDDEN_AFTER_ABORT = frozenset({"step", "validated", "page_received", "transfer_complete", "pages_read"})


# ---- 2. capacity ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolCapacity:
    """One pool's KV capacity."""

    pages: int
    page_size: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


def pool_capacities(
    server: dict[str, Any] | None, pool: PoolState, page_size: int
) -> dict[str, PoolCapacity]:
    """Each pool by name (`single`, `prefill`, `decode-1`...): the server's own numbers from
    /v1/audit/info, else its pages on /metrics (one series per role) x the auditor's page size."""
    if server is not None:
        pools = server["pools"].items()
        return {name: PoolCapacity(int(p["num_pages"]), int(p["page_size"])) for name, p in pools}
    return {name: PoolCapacity(pages, page_size) for name, pages in pool.pages_by_pool.items()}


def check_capacity(
    server: dict[str, Any] | None,
    pool: PoolState,
    boundary: Boundary | None,
    advertised: int | None,
    page_size: int,
) -> CheckResult:
    """Every pool alone must hold the window (the advertised one, or the measured largest prompt +
    max_tokens answered where that is larger), and the two windows must agree. Pools are never summed: a
    request's prompt (up to the window) lives whole in one prefill pool and prompt + output in one decode
    pool, so 16 prefill pages beside 128 decode pages hold a 256-token prompt, not 2304 tokens (the
    incident)."""
    pools = pool_capacities(server, pool, page_size)
    measured = boundary.accepted_total if boundary else None
    window = max((w for w in (advertised, measured) if w is not None), default=None)
    problems = [] if window is None else _pool_problems(pools, window, advertised)
    if not pools:
        problems.append({"problem": "no pool capacity: neither /v1/audit/info nor /metrics names a pool"})
    if boundary is None:
        problems.append({"problem": "the boundary probe found no window"})
    else:
        problems += _agreement_problems(boundary, advertised)
    sizes = ", ".join(f"{name} {c.pages} x {c.page_size} = {c.tokens}" for name, c in pools.items())
    ok = f"each pool holds the window alone ({sizes} tokens); advertised {advertised}, measured {measured}"
    result = verdict("capacity", problems, ok, [])
    result.evidence.append(
        {
            "pools": {name: {**asdict(c), "tokens": c.tokens} for name, c in pools.items()},
            "source": "/v1/audit/info" if server is not None else "/metrics pages x --page-size",
            "advertised_window": advertised,
            "measured": boundary.to_dict() if boundary else None,
            "note": "each pool compared alone with the window, never summed",
        }
    )
    return result


def _pool_problems(
    pools: dict[str, PoolCapacity], window: int, advertised: int | None
) -> list[dict[str, Any]]:
    """A problem for every pool that cannot hold a request of the whole window by itself."""
    source = "advertised" if window == advertised else "measured"
    return [
        {
            "problem": f"pool {name} holds {c.tokens} tokens ({c.pages} pages x {c.page_size}) but the "
            f"{source} window is {window}: each pool must hold a whole request alone, never summed",
            "pool": name,
            "pool_tokens": c.tokens,
            "window": window,
        }
        for name, c in pools.items()
        if c.tokens < window
    ]


def _agreement_problems(boundary: Boundary, advertised: int | None) -> list[dict[str, Any]]:
    """The advertised window must lie where the boundary probe found the server to start refusing."""
    lo = boundary.accepted_total
    hi = boundary.refused_total - 1 if boundary.refused_total is not None else lo
    if advertised is None or lo <= advertised <= hi:
        return []
    where_ = "refuses inside" if advertised > hi else "answers beyond"
    return [{"problem": f"advertised window {advertised}, but the server {where_} it (measured {lo}..{hi})"}]


# ---- 3. rejection terminates ------------------------------------------------------------------------


def check_rejections(exchanges: list[Exchange], trails: dict[str, Trail]) -> CheckResult:
    """Refused requests leave only `rejected` behind; inside/at the boundary is answered and finished."""
    problems: list[dict[str, Any]] = []
    labels = {e.label for e in exchanges}
    if not {"boundary:at", "boundary:beyond"} <= labels:
        problems.append({"problem": "the boundary probe found no boundary to test around"})
    refused = [e for e in exchanges if e.outcome == "refused" and e.request_id]
    for e in refused:
        problems += _rejection_problems(e, trails.get(str(e.request_id), []))
    for e in exchanges:
        if e.label in ("boundary:inside", "boundary:at"):
            trail = trails.get(str(e.request_id), [])
            if e.outcome != "answer" or not final_finishes(trail):
                problems.append({"problem": f"{e.label}: {e.outcome}, trail {_kinds(trail)}", **e.summary()})
    ids = [str(e.request_id) for e in refused]
    return verdict(
        "rejection_terminates", problems, f"{len(refused)} refusals left only a rejected event", ids
    )


def _rejection_problems(exchange: Exchange, trail: Trail) -> list[dict[str, Any]]:
    if not trail:
        return [{"problem": f"{exchange.label}: refused but it has no audit trail", **exchange.summary()}]
    kinds = [e["kind"] for e in trail]
    if "rejected" not in kinds:
        return [
            {"problem": f"{exchange.label}: HTTP {exchange.status} but no rejected event", "trail": kinds}
        ]
    after = [f"{where(e)}:{e['kind']}" for e in trail if e["kind"] in FORBIDDEN_AFTER_REJECTION]
    if after:
        return [{"problem": f"{exchange.label}: rejected, yet {', '.join(after)}", **exchange.summary()}]
    return []


def _kinds(trail: Trail) -> str:
    return " ".join(f"{where(e)}:{e['kind']}" if "where" in e else e["kind"] for e in trail) or "(none)"


# ---- 4. complete handoff ----------------------------------------------------------------------------


def check_handoff(
    exchanges: list[Exchange], trails: dict[str, Trail], expect_faults: Sequence[str]
) -> CheckResult:
    """A request whose KV was incomplete or wrong must abort with an integrity reason and no content; a
    200 must rest on a finished, fully fenced trail (decode after a verified transfer)."""
    uncaught: list[dict[str, Any]] = []  # listed first: the most direct evidence of a broken handoff
    problems: list[dict[str, Any]] = []
    caught = []
    for e in exchanges:
        trail = trails.get(str(e.request_id), []) if e.request_id else []
        if not trail or e.cancelled or e.outcome == "refused":
            continue
        if _integrity_aborts(trail):
            caught.append(str(e.request_id))
        fault = _uncaught_fault(e, trail)
        if fault:
            uncaught.append({"problem": f"{e.label}: {fault}", **e.summary()})
        problems += [{"problem": f"{e.label}: {p}", **e.summary()} for p in _handoff_problems(e, trail)]
    if expect_faults and not caught:
        problems.append(
            {"problem": f"fault(s) {', '.join(expect_faults)} armed, but no integrity abort was seen"}
        )
    ok = f"every answer rests on a finished, fenced trail; {len(caught)} integrity aborts returned no content"
    ids = caught + [str(p["request_id"]) for p in uncaught]
    return verdict("complete_handoff", uncaught + problems, ok, ids)


def _integrity_aborts(trail: Trail) -> Trail:
    return [e for e in trail if e["kind"] == "aborted" and e.get("reason") in INTEGRITY_REASONS]


def _uncaught_fault(exchange: Exchange, trail: Trail) -> str | None:
    """A fault fired on this request's path but it was not aborted with an integrity reason."""
    faults = [str(e.get("fault")) for e in trail if e["kind"] == "fault_injected"]
    if not faults or (_integrity_aborts(trail) and exchange.outcome == "aborted"):
        return None
    return f"fault {', '.join(faults)} fired, yet the request {_ending(exchange, trail)}"


def _handoff_problems(exchange: Exchange, trail: Trail) -> list[str]:
    """An integrity abort must be a clean error; an answer must rest on a finished, fenced trail."""
    integrity = _integrity_aborts(trail)
    if integrity or exchange.error_type == "kv_integrity_error":
        return _abort_problems(exchange, trail, integrity)
    return _answer_problems(trail) if exchange.outcome == "answer" else []


def _ending(exchange: Exchange, trail: Trail) -> str:
    reasons = [str(e.get("reason")) for e in trail if e["kind"] == "aborted"]
    return f"ended {exchange.outcome} (HTTP {exchange.status}) with trail abort reasons {reasons or 'none'}"


def _abort_problems(exchange: Exchange, trail: Trail, integrity: Trail) -> list[str]:
    problems = []
    if not integrity:
        problems.append("kv_integrity_error returned, but the trail has no integrity abort")
    if final_finishes(trail):
        problems.append("aborted for integrity, yet the trail also shows finished")
    if exchange.outcome != "aborted":
        problems.append(
            f"aborted for integrity ({integrity[0].get('reason') if integrity else '?'}), "
            f"yet the answer was {exchange.outcome}"
        )
    elif exchange.text and not exchange.stream:
        problems.append("integrity error returned together with content")
    return problems


def _answer_problems(trail: Trail) -> list[str]:
    problems = []
    if any(e["kind"] == "aborted" for e in trail):
        problems.append("answered 200, but the trail shows aborted")
    if not final_finishes(trail):
        problems.append("answered 200, but the trail has no finished event")
    for place, events in by_where(trail).items():
        unfenced = _unfenced_steps(events)
        if unfenced:
            problems.append(f"{unfenced} {place} step(s) ran without fence validation (isolation off?)")
        if place.partition("-")[0] == "decode" and _decoded_before_transfer(events):  # decode, decode-1
            problems.append("decode stepped before transfer_complete")
    return problems


def _unfenced_steps(events: Trail) -> int:
    """Steps with no `validated` event since the previous step."""
    count, validated = 0, False
    for event in events:
        if event["kind"] == "validated":
            validated = True
        elif event["kind"] == "step":
            count += not validated
            validated = False
    return count


def _decoded_before_transfer(events: Trail) -> bool:
    """Decode reserved pages for transferred KV but ran a step before the transfer was complete."""
    kinds = [e["kind"] for e in events]
    if "pages_allocated" not in kinds or "step" not in kinds:
        return False
    first_step = kinds.index("step")
    return kinds.index("pages_allocated") < first_step and "transfer_complete" not in kinds[:first_step]


# ---- 5. recycle timing ------------------------------------------------------------------------------


def check_recycle(
    exchanges: list[Exchange], trails: dict[str, Trail], pool: PoolState, recovery: CheckResult
) -> CheckResult:
    """Dropped streams: aborted -> (quarantined -> drained ->) released and nothing after the abort; no
    page reallocated while held (any audited request); the pool drains; a normal request succeeds."""
    dropped = [e for e in exchanges if e.cancelled and e.request_id]
    problems: list[dict[str, Any]] = []
    for e in dropped:
        problems += [
            {"problem": f"{e.label} {e.request_id}: {p}"}
            for p in _recycle_problems(trails.get(str(e.request_id), []))
        ]
    problems += reuse_violations(trails)
    if not pool.drained:
        problems.append(
            {
                "problem": f"pool not drained after {pool.waited_s:.0f}s: {pool.free_pages}/"
                f"{pool.total_pages} free, {pool.quarantined_pages} quarantined"
            }
        )
    if not recovery.passed:
        problems.append({"problem": f"no normal answer afterwards: {recovery.details}"})
    if not dropped:
        problems.append({"problem": "no stream was dropped mid-answer: nothing to check"})
    ok = (
        f"{len(dropped)} dropped streams released in order; no early reuse; "
        f"pool drained ({pool.total_pages} pages free); recovered"
    )
    return verdict("recycle_timing", problems, ok, [str(e.request_id) for e in dropped])


def _recycle_problems(trail: Trail) -> list[str]:
    if not trail:
        return ["no audit trail"]
    if not any(e["kind"] == "aborted" for e in trail):
        return [] if final_finishes(trail) else [f"dropped but never aborted: {_kinds(trail)}"]
    problems = []
    for place, events in by_where(trail).items():
        problems += [f"{place}: {p}" for p in _order_problems(events)]
    return problems


def _order_problems(events: Trail) -> list[str]:
    """One process's events after its abort: quarantine (if any) is drained before release, every held
    page is released, and no step, read or received page follows the abort."""
    kinds = [e["kind"] for e in events]
    if "aborted" not in kinds:
        return []
    after = kinds[kinds.index("aborted") + 1 :]
    problems = [f"{k} after aborted" for k in after if k in FORBIDDEN_AFTER_ABORT]
    if "quarantined" in after:
        rest = after[after.index("quarantined") :]
        if "drained" not in rest:
            problems.append("quarantined, never drained")
        elif "released" in rest[: rest.index("drained")]:
            problems.append("released before drained")
    if held_pages(events):
        problems.append(f"pages {sorted(held_pages(events))} never released")
    return problems


def reuse_violations(trails: dict[str, Trail]) -> list[dict[str, Any]]:
    """Pages allocated to one request while another (per process, by seq) still held them."""
    holds: dict[tuple[str, int], list[tuple[int, float, str]]] = defaultdict(list)
    for request_id, trail in trails.items():
        for place, events in by_where(trail).items():
            for page, start, end in _hold_intervals(events):
                holds[(place, page)].append((start, end, request_id))
    problems = []
    for request_id, trail in trails.items():
        for event in trail:
            if event["kind"] != "pages_allocated":
                continue
            for page in event_pages(event):
                for start, end, holder in holds[(where(event), page)]:
                    if holder != request_id and start < event["seq"] < end:
                        problems.append(
                            {
                                "problem": f"page {page} allocated to {request_id} (seq {event['seq']}) "
                                f"while {holder} held it (seq {start}..{end})"
                            }
                        )
    return problems


def _hold_intervals(events: Trail) -> list[tuple[int, int, float]]:
    """(page, acquired seq, released seq or infinity) for one process's events."""
    open_: dict[int, int] = {}
    intervals: list[tuple[int, int, float]] = []
    for event in events:
        if event["kind"] in ACQUIRE:
            open_.update(dict.fromkeys(event_pages(event), event["seq"]))
        elif event["kind"] == "released":
            intervals += [(p, open_.pop(p), event["seq"]) for p in event_pages(event) if p in open_]
    return intervals + [(p, s, math.inf) for p, s in open_.items()]


# ---- tenant pages -----------------------------------------------------------------------------------


def check_tenant_pages(trails: dict[str, Trail]) -> CheckResult:
    """No read of a page another tenant owns or wrote (pages_read, when the server traces pages) and no
    prefix hit on a page whose last audited allocation was another tenant's. Assumes the audit is the
    server's only client: the probes' unaudited requests (early drops) use prompts nobody else shares."""
    allocations: dict[tuple[str, int], list[tuple[int, str]]] = defaultdict(list)
    for trail in trails.values():
        tenant = tenant_of(trail)
        for event in trail:
            if event["kind"] == "pages_allocated" and tenant:
                for page in event_pages(event):
                    allocations[(where(event), page)].append((event["seq"], tenant))
    for history in allocations.values():
        history.sort()
    problems, shared = [], 0
    for request_id, trail in trails.items():
        tenant = tenant_of(trail)
        for event in trail:
            if event["kind"] in ("prefix_hit", "pages_read") and tenant:
                shared += 1
                problems += [
                    {"problem": f"{request_id} (tenant {tenant}) {p}"}
                    for p in _foreign(event, tenant, allocations)
                ]
    return verdict(
        "tenant_pages", problems, f"{shared} shared/read page events, all the reader's own tenant's", []
    )


def _foreign(
    event: Event, tenant: str, allocations: dict[tuple[str, int], list[tuple[int, str]]]
) -> list[str]:
    if event["kind"] == "pages_read":
        return [
            f"read page {p['page']} owned by {p['owner']}, written by {p['last_writer']}"
            for p in event["pages"]
            if p["owner"] != tenant or p["last_writer"] != tenant
        ]
    found = []
    for page in event_pages(event):
        before = [t for seq, t in allocations[(where(event), page)] if seq < event["seq"]]
        if before and before[-1] != tenant:
            found.append(f"prefix hit on page {page}, last allocated to tenant {before[-1]}")
    return found
