"""The router's reports of its workers: /v1/audit/info's pools, /metrics' stats and a request's trail
across every worker, each asked of the workers over the router's channel (router.py) and bounded by
`replies.py` before anything uses it.

Contracts:
- A worker that does not answer in time adds nothing: its stats have no series, its events are missing
  from a trail, its pins are those of the hello it was adopted with; none fails the whole report.
- What a reply drops or caps is handed to `drop_items` (the router counts it as `bad_reply`).
- Blocking: every report asks the workers and waits (never call one on the event loop).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from kvfence.disagg import replies
from kvfence.disagg.messages import Audit, AuditReply, Hello, HelloReply, Msg, Stats, StatsReply
from kvfence.disagg.placement import Placement
from kvfence.engine.stats import EngineStats
from kvfence.pins import code_info
from kvfence.trail.events import EventLog

Reply = TypeVar("Reply", bound=Msg)
POOLS_NOTE = (
    "each pool's pins are its worker's own claim (its hello, over the authenticated channel), typed and "
    "bounded by the router but not verified; capacity_tokens, max_model_len, page_size and isolation are "
    "the values the router uses, the capacity capped"
)


class BadReply(RuntimeError):
    """A worker answered, but nothing of its answer can be used (dropped, counted as `bad_reply`)."""


class Ask(Protocol):
    """The router's blocking question to one worker: only an `answer` from that worker answers it;
    TimeoutError when none comes."""

    def __call__(self, peer: str, question: Callable[[str], Msg], answer: type[Reply]) -> Reply: ...


class WorkerReports:
    """What the router reports of its workers, asked of them now."""

    def __init__(
        self,
        addresses: dict[str, str],
        placement: Placement,
        events: EventLog,
        rejected: Counter[str],
        authenticated: bool,
        ask: Ask,
        drop_items: Callable[[str, list[str]], None],
    ) -> None:
        """`addresses`: worker name -> address; `rejected`: the router's own dropped frames, by reason (read
        at each report); `authenticated`: the channel's frames are signed by the workers' keys."""
        self.addresses, self.placement, self.events = addresses, placement, events
        self.rejected, self.authenticated = rejected, authenticated
        self._ask, self._drop_items = ask, drop_items

    def info(self) -> dict[str, Any]:
        return {
            "mode": "disaggregated",
            "transport": {"kind": "zeromq", "authenticated": self.authenticated},
            "max_model_len": self.placement.max_model_len,
            "router": code_info(),
            "pools": {
                name: self._current_pins(name, worker.info) for name, worker in self.placement.workers.items()
            },
            "pools_note": POOLS_NOTE,
        }

    def _current_pins(self, name: str, adopted: dict[str, Any]) -> dict[str, Any]:
        """A worker's pins as it states them now (blocking): what its transport trusts changes when it
        replaces a landing process, and /v1/audit/info must not show a process that is gone. A fresh
        hello's pins, bounded as any hello's (what it drops was counted when the hello was adopted);
        the hello's own numbers stay those the router acts on. A lost or silent worker: the pins of the
        hello it was adopted with."""
        address = self.addresses[name]
        if address in self.placement.down:
            return adopted
        try:
            hello = self._ask(address, lambda t: Hello(token=t), HelloReply)
        except TimeoutError:
            return adopted
        shown, _ = replies.pins({k: v for k, v in hello.info.items() if k not in replies.HELLO_PINS})
        return {**shown, **{k: adopted[k] for k in replies.HELLO_PINS}}

    def stats(self) -> dict[str, EngineStats]:
        """Each reachable worker's pool (a lost one, or one whose answer is dropped, has no series until
        it answers again), and the frames and reply items this router dropped."""
        workers = {}
        for name, address in self.addresses.items():
            if address not in self.placement.down:
                # Neither a hung worker nor a lying one may take /metrics with it.
                with contextlib.suppress(TimeoutError, BadReply):
                    workers[name] = self.worker_stats(name)
        return {**workers, "router": EngineStats.transport_only(self.rejected)}

    def worker_stats(self, name: str) -> EngineStats:
        """One worker's pool and fence counters, and the frames it dropped (blocking); BadReply when its
        answer is not EngineStats within bounds."""
        address = self.addresses[name]
        stats, problems = replies.stats(self._ask(address, lambda t: Stats(token=t), StatsReply).stats)
        self._drop_items(address, problems)
        if stats is None:
            raise BadReply(f"{name}: {problems[-1]}")
        return stats

    def audit_events(self, request_id: str) -> list[dict[str, Any]]:
        """The request's trail across the router and every worker that answers, in time order; each
        worker's events are tagged with its name (`where`). A worker that does not answer in time (lost)
        adds nothing rather than failing the whole trail, and an event that is not sane (no `ts` to sort
        on, another request's, unbounded) is left out, the others kept."""
        events = [{**e, "where": "router"} for e in self.events.for_request(request_id)]
        for name, address in self.addresses.items():
            with contextlib.suppress(TimeoutError):
                reply = self._ask(address, lambda t: Audit(token=t, request_id=request_id), AuditReply)
                kept, problems = replies.events(reply.events, request_id)
                self._drop_items(address, problems)
                events += [{**e, "where": name} for e in kept]
        return sorted(events, key=lambda e: e["ts"])
