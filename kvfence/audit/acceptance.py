"""`kvfence audit`: the five acceptance checks of a running kvfence service, plus the black-box probes.

The probes (probe.py) drive the server over HTTP; with the admin key this module then reads every probe
request's audit trail (`GET /v1/audit/requests/{id}`) and `/metrics`, and checks:

1. pinned_versions        engine version, git commit, model file sha256, transport, start-up flags;
2. capacity               pool capacity (pages from /metrics x page size) vs the advertised window and
                          the window measured by the boundary probe: the window must fit the pool;
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
plus tenant_pages         no request reads a page another tenant wrote (pages_read) or shares a cached page
                          last allocated to another tenant (prefix_hit).

`--black-box` runs only the probes (for engines without an audit trail). Output: a table on stdout, a
progress bar on stderr, `--json FILE`, and `--html FILE` (self-contained: inline CSS and SVG timelines of
every probe request's pages). The exit status is 1 when any check fails, 2 on a usage error.

Pins come from the server itself (`GET /v1/audit/info`: per pool the kvfence version and commit, the model
file's sha256, page size, pages, window, isolation); `--model-file` names the file the auditor expects it to
serve. Against a server without that endpoint they are computed client-side and labelled so: the auditor's
installed kvfence, the sha256 of `--model-file` (default: the packaged model), and `--page-size`.
"""

from __future__ import annotations

import argparse
import html
import json
import math
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx
from prometheus_client.parser import text_string_to_metric_families

import kvfence
from kvfence.audit.probe import (
    PROBE_STEPS,
    Boundary,
    CheckResult,
    Exchange,
    Target,
    check_test_address,
    discover,
    run_probes,
    verdict,
)
from kvfence.pins import file_sha256, git_commit, package_version
from kvfence.trail.reasons import INTEGRITY_REASONS

Event = dict[str, Any]
Trail = list[Event]
DEFAULT_PAGE_SIZE = 16
SETTLE_TIMEOUT_S = 20.0  # how long trails and the pool may take to reach their final state
ENGINE = "engine"  # the `where` of a single-node event (those carry no `where` field)
ACQUIRE = ("pages_allocated", "prefix_hit")
TERMINAL = ("finished", "rejected", "aborted")
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


# ---- reading the server -----------------------------------------------------------------------------


class AuditError(RuntimeError):
    """The audit trail cannot be read (wrong admin key, not a kvfence server)."""


class AuditReader:
    """Admin reads of one kvfence server: request trails and /metrics."""

    def __init__(self, url: str, admin_key: str, timeout_s: float = 30.0) -> None:
        self.http = httpx.Client(
            base_url=url, timeout=timeout_s, headers={"authorization": f"Bearer {admin_key}"}
        )

    def close(self) -> None:
        self.http.close()

    def trail(self, request_id: str) -> Trail:
        """The request's events ([] when the server has none); AuditError when the key is refused."""
        response = self.http.get(f"/v1/audit/requests/{request_id}")
        if response.status_code == 404:
            return []
        if response.status_code != 200:
            raise AuditError(f"GET /v1/audit/requests/{request_id}: HTTP {response.status_code}")
        return list(response.json()["events"])

    def info(self) -> dict[str, Any] | None:
        """What the server reports pins it (GET /v1/audit/info); None when it has no such endpoint."""
        response = self.http.get("/v1/audit/info")
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise AuditError(f"GET /v1/audit/info: HTTP {response.status_code}")
        return dict(response.json())

    def metrics(self) -> dict[str, dict[str, float]]:
        """Sample name -> {label values joined by ',' (or '') -> value}."""
        samples: dict[str, dict[str, float]] = defaultdict(dict)
        for family in text_string_to_metric_families(self.http.get("/metrics").text):
            for sample in family.samples:
                samples[sample.name][",".join(sample.labels.values())] = sample.value
        return dict(samples)


def where(event: Event) -> str:
    return str(event.get("where", ENGINE))


def by_where(trail: Trail) -> dict[str, Trail]:
    """The trail split per process (router/prefill/decode, or ENGINE), each in its own seq order."""
    groups: dict[str, Trail] = defaultdict(list)
    for event in trail:
        groups[where(event)].append(event)
    return {w: sorted(events, key=lambda e: e["seq"]) for w, events in groups.items()}


def event_pages(event: Event) -> list[int]:
    """The pages an event names: a `pages` list (ints, or pages_read dicts) or one `page`. A `pages`
    count (transfer_started, transfer_complete) names none."""
    if "page" in event:
        return [int(event["page"])]
    pages = event.get("pages")
    if not isinstance(pages, list):
        return []
    return [int(p["page"]) if isinstance(p, dict) else int(p) for p in pages]


def held_pages(events: Trail) -> set[int]:
    """Pages one process's events acquired and have not released yet."""
    held: set[int] = set()
    for event in events:
        if event["kind"] in ACQUIRE:
            held |= set(event_pages(event))
        elif event["kind"] == "released":
            held -= set(event_pages(event))
    return held


def settled(trail: Trail) -> bool:
    """The request reached a terminal event and holds no page anywhere."""
    kinds = {e["kind"] for e in trail}
    return bool(kinds & set(TERMINAL)) and not any(held_pages(ev) for ev in by_where(trail).values())


def final_finishes(trail: Trail) -> Trail:
    """`finished` events that end the request (a prefill worker's "transferred" only hands it on)."""
    return [e for e in trail if e["kind"] == "finished" and e.get("reason") != "transferred"]


def tenant_of(trail: Trail) -> str | None:
    return next((str(e["tenant"]) for e in trail if e["kind"] == "admitted" and "tenant" in e), None)


def collect_trails(
    reader: AuditReader, request_ids: Iterable[str], timeout_s: float = SETTLE_TIMEOUT_S
) -> dict[str, Trail]:
    """Every request's trail, polled until it settled or `timeout_s` passed (unsettled ones as they are)."""
    pending, trails = set(request_ids), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for request_id in sorted(pending):
            trails[request_id] = reader.trail(request_id)
            if settled(trails[request_id]):
                pending.discard(request_id)
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    return trails


@dataclass
class PoolState:
    """The pool as /metrics shows it once the audit's requests are over."""

    total_pages: int
    free_pages: int
    quarantined_pages: int
    waited_s: float

    @property
    def drained(self) -> bool:
        return self.total_pages > 0 and self.free_pages == self.total_pages and self.quarantined_pages == 0


def pool_state(metrics: dict[str, dict[str, float]], waited_s: float = 0.0) -> PoolState:
    states = metrics.get("kvfence_pages", {})
    return PoolState(
        int(sum(states.values())),
        int(metrics.get("kvfence_pages_free", {}).get("", 0)),
        int(states.get("quarantined", 0)),
        waited_s,
    )


def wait_for_drained_pool(reader: AuditReader, timeout_s: float = SETTLE_TIMEOUT_S) -> PoolState:
    """Poll /metrics until every page is free again (or the timeout): cancelled and aborted requests,
    including those dropped before their id was known, must give every page back."""
    started = time.monotonic()
    while True:
        state = pool_state(reader.metrics(), time.monotonic() - started)
        if state.drained or state.waited_s > timeout_s:
            return state
        time.sleep(0.2)


# ---- 1. pinned versions -----------------------------------------------------------------------------


def default_model_file() -> Path | None:
    from kvfence.pins import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def check_pinned(
    server: dict[str, Any] | None,
    model_file: Path | None,
    served_model: str,
    flags: str | None,
    trails: dict[str, Trail],
) -> CheckResult:
    """Record what pins the service and fail when it is unknown or inconsistent.

    With the server's own report (`GET /v1/audit/info`) every pool must name the same code and a model
    sha256, the same for all pools, and equal to `model_file`'s when the auditor names the file it expects.
    Without one (an older server) the pins are the auditor's checkout and model file, labelled client-side."""
    if server is not None:
        return _pinned_by_server(server, model_file, served_model, flags)
    commit, dirty = git_commit(Path(kvfence.__file__).parent)
    path = model_file or default_model_file()
    sha = file_sha256(path) if path and path.is_file() else None
    disaggregated = any("where" in e for trail in trails.values() for e in trail)
    pins = {
        "engine_version": package_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "model_file": str(path) if path else None,
        "model_sha256": sha,
        "served_model": served_model,
        "served_model_matches_file": bool(path and path.stem == served_model),
        "transport": "ZeroMQ connector (disaggregated)" if disaggregated else "none (single node)",
        "startup_flags": flags,
        "source": "client-side: the server has no /v1/audit/info; the auditor's kvfence and model file",
    }
    problems = [
        {"problem": f"{name} unknown"} for name in ("engine_version", "model_sha256") if not pins[name]
    ]
    ok = (
        f"kvfence {pins['engine_version']} @ {_commit_label(commit, dirty)} "
        f"(client-side); model sha256 {str(sha)[:16]}…; transport {pins['transport']}; "
        f"flags: {flags or 'not given'}"
    )
    return _pinned_verdict(problems, ok, pins)


def _commit_label(commit: str | None, dirty: bool) -> str:
    return (commit or "no git")[:12] + (" (dirty)" if dirty else "")


def _pinned_verdict(problems: list[dict[str, Any]], ok: str, pins: dict[str, Any]) -> CheckResult:
    """The pinned_versions verdict, with what pins the service as its evidence."""
    result = verdict("pinned_versions", problems, ok, [])
    result.evidence.append(pins)
    return result


def _pinned_by_server(
    server: dict[str, Any], model_file: Path | None, served_model: str, flags: str | None
) -> CheckResult:
    pools: dict[str, dict[str, Any]] = server["pools"]
    problems: list[dict[str, Any]] = []
    for key, what in (("model_sha256", "model sha256"), ("kvfence_version", "engine version")):
        values = {role: pool.get(key) for role, pool in pools.items()}
        problems += [{"problem": f"{what} unknown", "pool": role} for role, v in values.items() if not v]
        if len(set(values.values())) > 1:
            problems.append({"problem": f"pools report different {what}s", "values": values})
    for key in ("git_commit", "page_size"):
        values = {role: pool.get(key) for role, pool in pools.items()}
        if len(set(values.values())) > 1:
            problems.append({"problem": f"pools report different {key} values", "values": values})
    expected = file_sha256(model_file) if model_file and model_file.is_file() else None
    first = next(iter(pools.values()))
    served = first.get("model_sha256")
    if expected and served and expected != served:
        problems.append({"problem": "the server's model is not the expected file", "expected": expected})
    pins = {
        **server,
        "served_model": served_model,
        "expected_model_sha256": expected,
        "startup_flags": flags,
        "source": "server: GET /v1/audit/info",
    }
    commit = _commit_label(first.get("git_commit"), bool(first.get("git_dirty")))
    expectation = "as expected" if expected else "no expected file given"
    ok = (
        f"kvfence {first.get('kvfence_version')} @ {commit}; model sha256 {str(served)[:16]}… "
        f"({expectation}); {server['mode']}, {len(pools)} pool(s); flags: {flags or 'not given'}"
    )
    return _pinned_verdict(problems, ok, pins)


# ---- 2. capacity ------------------------------------------------------------------------------------


def check_capacity(
    pool: PoolState, boundary: Boundary | None, advertised: int | None, page_size: int, disaggregated: bool
) -> CheckResult:
    """The measured window (largest prompt+max_tokens answered) and the advertised one must agree and
    fit the pool (pages summed over /metrics states x page size)."""
    pool_tokens = pool.total_pages * page_size
    facts: dict[str, Any] = {
        "pool_pages": pool.total_pages,
        "page_size": page_size,
        "pool_tokens": pool_tokens,
        "advertised_window": advertised,
        "measured": boundary.to_dict() if boundary else None,
        "note": "pages summed over prefill and decode pools" if disaggregated else "single pool",
    }
    problems = []
    if pool.total_pages == 0:
        problems.append({"problem": "/metrics shows no kvfence_pages: pool capacity unknown"})
    if boundary is None:
        problems.append({"problem": "the boundary probe found no window"})
    else:
        problems += _window_problems(boundary, advertised, pool_tokens)
    measured = boundary.accepted_total if boundary else "?"
    ok = (
        f"pool {pool.total_pages} pages x {page_size} = {pool_tokens} tokens; "
        f"advertised window {advertised}; measured {measured} tokens: fits"
    )
    result = verdict("capacity", problems, ok, [])
    result.evidence.append(facts)
    return result


def _window_problems(boundary: Boundary, advertised: int | None, pool_tokens: int) -> list[dict[str, Any]]:
    lo = boundary.accepted_total
    hi = boundary.refused_total - 1 if boundary.refused_total is not None else lo
    problems = []
    if pool_tokens and lo > pool_tokens:
        problems.append({"problem": f"answered {lo} tokens but the pool holds {pool_tokens}"})
    if advertised is not None and pool_tokens and advertised > pool_tokens:
        problems.append(
            {"problem": f"advertised window {advertised} does not fit the pool ({pool_tokens} tokens)"}
        )
    if advertised is not None and not lo <= advertised <= hi:
        where_ = "refuses inside" if advertised > hi else "answers beyond"
        problems.append(
            {"problem": f"advertised window {advertised}, but the server {where_} it (measured {lo}..{hi})"}
        )
    return problems


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
        if place == "decode" and _decoded_before_transfer(events):
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


# ---- the report -------------------------------------------------------------------------------------


class ProgressBar:
    """`bar(step)` marks one more step done: `[#####.....] 3/8 step` on stderr."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24) -> None:
        self.total, self.stream, self.width, self.done = total, stream, width, 0

    def __call__(self, step: str) -> None:
        self.done = min(self.total, self.done + 1)
        filled = self.width * self.done // self.total
        end = "\n" if self.done == self.total or not self.stream.isatty() else ""
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {step:<20}{end}"
        )
        self.stream.flush()


@dataclass
class Report:
    target: dict[str, Any]
    results: list[CheckResult]
    exchanges: list[Exchange]
    trails: dict[str, Trail] = field(default_factory=dict)
    boundary: Boundary | None = None
    page_size: int = DEFAULT_PAGE_SIZE

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.results)

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "passed": self.passed,
            "checks": [r.to_dict() for r in self.results],
            "boundary": self.boundary.to_dict() if self.boundary else None,
            "exchanges": [e.summary() for e in self.exchanges],
            "trails": self.trails,
        }


def render_table(results: list[CheckResult], width: int = 96) -> str:
    """One line per check: name, PASS/FAIL/SKIP, details (shortened to fit `width`)."""
    name_w = max(len(r.name) for r in results)
    room = max(20, width - name_w - 10)
    lines = [f"  {'check':<{name_w}}  result  details", f"  {'-' * name_w}  ------  {'-' * room}"]
    for r in results:
        details = r.details if len(r.details) <= room else r.details[: room - 1] + "…"
        lines.append(f"  {r.name:<{name_w}}  {r.status:<6}  {details}")
    return "\n".join(lines)


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
.PASS{background:#e5f5e0}.FAIL{background:#fee0d2}.SKIP{background:#eee}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:24em}
section{margin:1.5em 0}h3{font-size:14px;margin:.3em 0}svg text{font:10px monospace}
"""


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML page (inline CSS and SVG, nothing fetched)."""
    status = "PASS" if report.passed else "FAIL"
    rows = "".join(
        f"<tr class='{r.status}'><td>{_e(r.name)}</td><td>{r.status}</td><td>{_e(r.details)}</td></tr>"
        for r in report.results
    )
    evidence = "".join(
        f"<details><summary>{_e(r.name)} ({len(r.evidence)})</summary>"
        f"<pre>{_e(json.dumps(r.evidence, indent=1, default=str))}</pre></details>"
        for r in report.results
        if r.evidence
    )
    target = _e(json.dumps(report.target, default=str))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvfence audit: {status}</title>"
        f"<style>{_CSS}</style></head><body><h1 class='{status}'>kvfence audit: {status}</h1>"
        f"<p><code>{target}</code></p><table><tr><th>check</th><th>result</th><th>details</th></tr>{rows}</table>"
        f"<h2>Evidence</h2>{evidence or '<p>none</p>'}"
        f"<h2>Page timelines</h2>{_legend()}{_timelines(report)}</body></html>"
    )


def _timelines(report: Report) -> str:
    sections = []
    for e in report.exchanges:
        trail = report.trails.get(str(e.request_id)) if e.request_id else None
        if trail:
            title = f"{e.label} · key #{e.key_index} · {e.outcome} (HTTP {e.status}) · {e.request_id}"
            sections.append(f"<section><h3>{_e(title)}</h3>{timeline_svg(trail, report.page_size)}</section>")
    return "".join(sections) or "<p>no audit trails (black-box run)</p>"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


# ---- page timelines (SVG) ---------------------------------------------------------------------------

_COLORS = {
    "alloc": "#31a354",
    "share": "#17becf",
    "write": "#3182bd",
    "read": "#636363",
    "foreign": "#de2d26",
    "quarantine": "#e6550d",
    "release": "#000000",
    "held": "#c6dbef",
    "quarantined": "#fdd0a2",
}
_LABEL_W, _PLOT_W, _ROW_H, _TOP = 130, 720, 14, 22
MAX_TIMELINE_ROWS = 48


@dataclass
class PageLife:
    """One page's lifecycle within one request's trail: held spans, quarantine start, and markers."""

    spans: list[list[float]] = field(default_factory=list)  # [start, end] (end NaN while still held)
    quarantined_at: float | None = None
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (ts, mark kind, tooltip)


def page_lives(trail: Trail, page_size: int) -> dict[tuple[str, int], PageLife]:
    """(where, page) -> its life, from allocation (or prefix hit) through writes, reads, quarantine and
    release. Step writes are mapped to pages through the request's own record order."""
    lives: dict[tuple[str, int], PageLife] = defaultdict(PageLife)
    tenant = tenant_of(trail)
    for place, events in by_where(trail).items():
        record: list[int] = []
        for event in events:
            _apply(event, place, record, lives, tenant, page_size)
    return dict(lives)


def _apply(
    event: Event,
    place: str,
    record: list[int],
    lives: dict[tuple[str, int], PageLife],
    tenant: str | None,
    page_size: int,
) -> None:
    kind, ts, pages = event["kind"], float(event["ts"]), event_pages(event)
    tip = f"{kind} seq {event['seq']}"
    if kind in ACQUIRE:
        record += pages
        for p in pages:
            lives[(place, p)].spans.append([ts, math.nan])
            lives[(place, p)].marks.append((ts, "alloc" if kind == "pages_allocated" else "share", tip))
    elif kind == "step":
        pos, n = int(event.get("position", 0)), int(event.get("tokens", 0))
        for logical in range(pos // page_size, (pos + max(n, 1) - 1) // page_size + 1):
            if logical < len(record):
                lives[(place, record[logical])].marks.append(
                    (ts, "write", f"{tip} (tokens {pos}..{pos + n})")
                )
    elif kind in ("page_received", "validated"):
        for p in pages:
            lives[(place, p)].marks.append((ts, "write" if kind == "page_received" else "read", tip))
    elif kind == "pages_read":
        for p in event["pages"]:
            foreign = p["owner"] != tenant or p["last_writer"] != tenant
            lives[(place, int(p["page"]))].marks.append(
                (ts, "foreign" if foreign else "read", f"{tip} writer {p['last_writer']}")
            )
    elif kind == "quarantined":
        for p in pages:
            lives[(place, p)].quarantined_at = ts
            lives[(place, p)].marks.append((ts, "quarantine", tip))
    elif kind == "released":
        record.clear()
        for p in pages:
            life = lives[(place, p)]
            life.marks.append((ts, "release", tip))
            if life.spans and math.isnan(life.spans[-1][1]):
                life.spans[-1][1] = ts


def timeline_svg(trail: Trail, page_size: int) -> str:
    """Time runs left to right (ms since the request's first event). Top row: every event; then one row
    per page: a bar while held (orange once quarantined) with markers for allocate, write, read, release."""
    t0 = min(float(e["ts"]) for e in trail)
    t1 = max(float(e["ts"]) for e in trail)
    span = max(t1 - t0, 1e-3)
    lives = page_lives(trail, page_size)
    rows = sorted(lives, key=lambda k: (k[0], min((m[0] for m in lives[k].marks), default=0.0)))
    shown = rows[:MAX_TIMELINE_ROWS]
    height = _TOP + _ROW_H * (max(len(shown), 1) + 1) + 14

    def x(ts: float) -> float:
        return _LABEL_W + _PLOT_W * (ts - t0) / span

    parts = [_axis(span), *_event_row(trail, x)]
    for i, key in enumerate(shown):
        parts += _page_row(key, lives[key], _TOP + _ROW_H * (i + 1), x, t1)
    if len(rows) > len(shown):
        parts.append(_tag("text", f"… {len(rows) - len(shown)} more pages", x=4, y=height - 4))
    if not rows:
        parts.append(_tag("text", "no pages: nothing was allocated", x=_LABEL_W, y=_TOP + _ROW_H + 10))
    return _tag("svg", "".join(parts), xmlns=_SVG_NS, width=_LABEL_W + _PLOT_W + 50, height=height)


_SVG_NS = "http://www.w3.org/2000/svg"
_EVENT_COLORS = {
    "rejected": "#de2d26",
    "aborted": "#de2d26",
    "finished": "#31a354",
    "fault_injected": "#8856a7",
}


def _tag(name: str, body: str = "", **attrs: object) -> str:
    """An SVG element; attribute names use `_` for `-`, values are escaped, `body` is inserted as is."""
    text = "".join(
        f" {k.rstrip('_').replace('_', '-')}='{_e(f'{v:.1f}' if isinstance(v, float) else v)}'"
        for k, v in attrs.items()
    )
    return f"<{name}{text}>{body}</{name}>"


def _axis(span: float) -> str:
    ticks = []
    for i in range(6):
        x = _LABEL_W + _PLOT_W * i / 5
        ticks.append(_tag("line", x1=x, y1=_TOP - 6, x2=x, y2=_TOP - 2, stroke="#999"))
        ticks.append(_tag("text", f"{span * 1000 * i / 5:.0f} ms", x=x, y=_TOP - 9, text_anchor="middle"))
    return "".join(ticks)


def _event_row(trail: Trail, x: Callable[[float], float]) -> list[str]:
    parts = [_tag("text", "events", x=4, y=_TOP + 10)]
    hidden = ("ts", "seq", "kind", "request_id", "where")
    for event in trail:
        fields = json.dumps({k: v for k, v in event.items() if k not in hidden}, default=str)[:200]
        tip = _tag("title", _e(f"{event.get('where', '')} {event['kind']} seq {event['seq']} {fields}"))
        at = x(float(event["ts"]))
        color = _EVENT_COLORS.get(event["kind"], "#888")
        parts.append(
            _tag("line", tip, x1=at, y1=_TOP + 1, x2=at, y2=_TOP + _ROW_H - 1, stroke=color, stroke_width=2)
        )
    return parts


def _page_row(
    key: tuple[str, int], life: PageLife, y: int, x: Callable[[float], float], t_end: float
) -> list[str]:
    place, page = key
    parts = [_tag("text", _e(f"{place} p{page}" if place != ENGINE else f"page {page}"), x=4, y=y + 10)]
    for start, end in life.spans:
        still_held = math.isnan(end)
        stop = t_end if still_held else end
        q = life.quarantined_at
        q = q if q is not None and start <= q <= stop else stop
        parts.append(_bar(x(start), x(q), y, _COLORS["held"], still_held))
        if q < stop:
            parts.append(_bar(x(q), x(stop), y, _COLORS["quarantined"], still_held))
    for ts, mark, tip in life.marks:
        title = _tag("title", _e(f"{mark}: {tip}"))
        parts.append(
            _tag("rect", title, x=x(ts) - 2, y=y + 2, width=4, height=_ROW_H - 4, fill=_COLORS[mark])
        )
    return parts


def _bar(x0: float, x1: float, y: int, color: str, dashed: bool) -> str:
    """A held span; dashed outline when the page was still held at the trail's last event."""
    dash = {"stroke": "#e6550d", "stroke_dasharray": "3,2"} if dashed else {}
    return _tag("rect", x=x0, y=y + 3, width=max(x1 - x0, 1.0), height=_ROW_H - 6, fill=color, **dash)


def _legend() -> str:
    items = [("held", "held"), ("quarantined", "quarantined"), ("alloc", "allocate"), ("share", "prefix hit")]
    items += [("write", "write / receive"), ("read", "read (validated)"), ("foreign", "foreign read")]
    items += [("quarantine", "quarantine"), ("release", "release")]
    cells = "".join(
        _tag("rect", x=i * 110, y=2, width=10, height=10, fill=_COLORS[k])
        + _tag("text", _e(text), x=i * 110 + 14, y=11)
        for i, (k, text) in enumerate(items)
    )
    return _tag("svg", cells, xmlns=_SVG_NS, width=110 * len(items), height=16)


# ---- the command ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvfence audit` options."""
    parser.add_argument("--url", required=True, help="server base URL (loopback or private test address)")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="a tenant's key (repeat: at least two tenants)",
    )
    parser.add_argument(
        "--admin-key", help="the server's admin key (reads audit trails; not needed with --black-box)"
    )
    parser.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the full report as JSON")
    parser.add_argument(
        "--html", type=Path, metavar="FILE", help="write a self-contained HTML report with page timelines"
    )
    parser.add_argument(
        "--black-box", action="store_true", help="only the HTTP probes (engines without an audit trail)"
    )
    parser.add_argument(
        "--model-file", type=Path, help="the GGUF file served, for its sha256 (default: the packaged model)"
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help="tokens per KV page, for a server without /v1/audit/info (default: %(default)s)",
    )
    parser.add_argument("--server-flags", help="the server's start-up flags, recorded as given")
    parser.add_argument(
        "--expect-fault",
        action="append",
        default=[],
        metavar="NAME",
        help="a fault armed on the server: it must be caught",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per request (default: %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    """Run the audit: 0 when every check passes, 1 when one fails, 2 on a usage or connection error."""
    url = str(args.url).rstrip("/").removesuffix("/v1")
    keys = tuple(args.api_key)
    problem = _usage_problem(url, keys, args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        served, advertised = discover(url, keys[0])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"error: cannot list the models of {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        report = _audit(url, keys, args.model or served, advertised, args)
    except (httpx.HTTPError, AuditError) as exc:
        print(f"error: cannot audit {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _write_outputs(report, args)
    print(render_table(report.results))
    failing = [r.name for r in report.results if r.passed is False]
    print(f"audit {'FAILED: ' + ', '.join(failing) if failing else 'PASSED'}")
    return 0 if report.passed else 1


def _usage_problem(url: str, keys: tuple[str, ...], args: argparse.Namespace) -> str | None:
    if len(keys) < 2:
        return "give --api-key at least twice (two tenants) for the tenant checks"
    if not args.black_box and not args.admin_key:
        return "--admin-key is needed to read audit trails (or use --black-box)"
    try:
        check_test_address(url)
    except ValueError as exc:
        return str(exc)
    return None


def _audit(
    url: str, keys: tuple[str, ...], model: str, advertised: int | None, args: argparse.Namespace
) -> Report:
    steps = len(PROBE_STEPS) + (1 if args.black_box else 3)
    bar = ProgressBar(steps)
    probes = run_probes(Target(url, keys, model, args.timeout), advertised, bar)
    target = {
        "url": url,
        "model": model,
        "advertised_window": advertised,
        "tenants": len(keys),
        "black_box": args.black_box,
    }
    report = Report(
        target, list(probes.results), probes.exchanges, boundary=probes.boundary, page_size=args.page_size
    )
    if not args.black_box:
        report.results += _white_box(url, args, report, bar)
    bar("report")
    return report


def _white_box(url: str, args: argparse.Namespace, report: Report, bar: ProgressBar) -> list[CheckResult]:
    """The five acceptance checks and tenant_pages, from the probe requests' trails and /metrics."""
    reader = AuditReader(url, args.admin_key, args.timeout)
    try:
        bar("trails")
        ids = [str(e.request_id) for e in report.exchanges if e.request_id]
        report.trails = trails = collect_trails(reader, ids)
        pool = wait_for_drained_pool(reader)
        server = reader.info()
    finally:
        reader.close()
    if server is not None:  # the server's own page size, not the auditor's guess
        report.page_size = next(iter(server["pools"].values()))["page_size"]
    bar("checks")
    disaggregated = any("where" in e for t in trails.values() for e in t)
    recovery = next(r for r in report.results if r.name == "recovery")
    exchanges, advertised = report.exchanges, report.target["advertised_window"]
    return [
        check_pinned(server, args.model_file, report.target["model"], args.server_flags, trails),
        check_capacity(pool, report.boundary, advertised, report.page_size, disaggregated),
        check_rejections(exchanges, trails),
        check_handoff(exchanges, trails, args.expect_fault),
        check_recycle(exchanges, trails, pool, recovery),
        check_tenant_pages(trails),
    ]


def _write_outputs(report: Report, args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=1, default=str), encoding="utf-8")
    if args.html:
        args.html.write_text(render_html(report), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvfence.audit.acceptance ...` until the `kvfence audit` subcommand is wired."""
    parser = argparse.ArgumentParser(
        prog="kvfence audit", description="Acceptance checks of a kvfence server."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
