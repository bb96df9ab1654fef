"""Reading one request's audit trail (the events `GET /v1/audit/requests/{id}` returns): which process
each event ran in, the pages events name and a process still holds, whether the request has settled, and
the pool as /metrics shows it. Pure functions over JSON events: no HTTP, no torch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

Event = dict[str, Any]
Trail = list[Event]
ENGINE = "engine"  # the `where` of a single-node event (those carry no `where` field)
ACQUIRE = ("pages_allocated", "prefix_hit", "forked")  # a fork's event names the pages it maps
TERMINAL = ("finished", "rejected", "aborted")


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


@dataclass
class PoolState:
    """The pool as /metrics shows it once the audit's requests are over: the counts over every pool, and
    each pool's own pages (`pages_by_pool`, by `role`), since a request must fit one pool alone."""

    total_pages: int
    free_pages: int
    quarantined_pages: int
    waited_s: float
    pages_by_pool: dict[str, int] = field(default_factory=dict)

    @property
    def drained(self) -> bool:
        return self.total_pages > 0 and self.free_pages == self.total_pages and self.quarantined_pages == 0


def pool_state(metrics: dict[str, list[tuple[dict[str, str], float]]], waited_s: float = 0.0) -> PoolState:
    """Every pool of the server (one series per role and state on /metrics): totals and per pool."""
    pages = metrics.get("kvfence_pages", [])
    by_pool: dict[str, int] = defaultdict(int)
    for labels, value in pages:
        by_pool[labels.get("role", ENGINE)] += int(value)
    return PoolState(
        int(sum(value for _, value in pages)),
        int(sum(value for _, value in metrics.get("kvfence_pages_free", []))),
        int(sum(value for labels, value in pages if labels.get("state") == "quarantined")),
        waited_s,
        dict(by_pool),
    )
