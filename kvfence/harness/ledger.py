"""Which armed faults took effect, whom they hit, and whether the fence caught each one.

A fault can fire and change nothing (no other page is held, no other row shares the batch), so a harness
judges effects, not firings. The contract is `FaultInjector.record(name, **detail)`, called by an
injection point when its fault changed something:

  fault                    call site                                   detail
  double_allocation        PageAllocator._take_page                    page, generation (the holders' one)
  stale_mapping            PageAllocator._free_a_held_page             page, generation
  cross_tenant_prefix_hit  PrefixCache._foreign_pages                  tenant (id), pages
  read_beyond_written      Scheduler._believe_unwritten_prefix         request_id, tokens
  stale_write              ModelRunner.execute                         request_id (the writer), page

`FaultLedger` listens on the engine thread and, for a page-level effect, notes the requests that map the
page at the generation it had: those are the ones the fence must stop. `verdicts` then judges each effect
from how its victims ended.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvfence.cache.fence import MappingRecord
from kvfence.engine.engine import LLMEngine
from kvfence.trail.faults import FaultEffect
from kvfence.trail.reasons import INTEGRITY_REASONS

SINGLE_NODE_FAULTS = (
    "stale_mapping",
    "double_allocation",
    "read_beyond_written",
    "cross_tenant_prefix_hit",
    "stale_write",
)
PAGE_FAULTS = frozenset({"double_allocation", "stale_mapping"})


def _mappings(record: MappingRecord) -> list[tuple[int, int]]:
    return list(zip(record.pages, record.generations, strict=True))


# ---- the ledger ------------------------------------------------------------------------------------------


@dataclass
class Hit:
    """One effect and the requests it hit (resolved when it happened)."""

    fault: str
    detail: dict[str, Any]
    victims: list[str]


@dataclass(frozen=True)
class Verdict:
    """caught: a victim was aborted by an integrity check and none completed wrong. absorbed: nothing
    wrong was ever read (no victim, or each victim left first: cancelled, preempted, or finished with its
    reference output). missed: a victim completed with output that differs from its reference.
    unresolved: a victim's end is unknown to the harness."""

    fault: str
    verdict: str
    victims: dict[str, str]  # request id -> how it ended


@dataclass
class FaultLedger:
    engine: LLMEngine
    hits: list[Hit] = field(default_factory=list)

    @classmethod
    def attach(cls, engine: LLMEngine) -> FaultLedger:
        """Listen to the engine's fault effects (call before the engine runs)."""
        ledger = cls(engine)
        engine.faults.listeners.append(ledger._on_effect)
        return ledger

    def _on_effect(self, effect: FaultEffect) -> None:
        """On the engine thread, at the moment of the effect."""
        self.hits.append(Hit(effect.fault, dict(effect.detail), self._victims(effect)))

    def _victims(self, effect: FaultEffect) -> list[str]:
        detail = effect.detail
        if "request_id" in detail:
            return [detail["request_id"]]
        if effect.fault in PAGE_FAULTS:
            target = (detail["page"], detail["generation"])
            live = [*self.engine.requests.values(), *self.engine.scheduler.quarantined.values()]
            return [r.request_id for r in live if target in _mappings(r.record)]
        if effect.fault == "cross_tenant_prefix_hit":
            # PrefixCache.lookup is called only while the scheduler admits a request.
            admitting = self.engine.scheduler.admitting
            return [admitting.request_id] if admitting else []
        return []

    def verdicts(self, received_ok: Callable[[str], bool | None]) -> list[Verdict]:
        """Judge every effect. `received_ok(request_id)`: True when what the request's client received is
        its reference output (or, having hung up, the start of it), False when a completed output differs,
        None when that cannot be told (judge.received_ok_by_request)."""
        return [self._judge(hit, received_ok) for hit in self.hits]

    def _judge(self, hit: Hit, received_ok: Callable[[str], bool | None]) -> Verdict:
        endings = {rid: self._ending(rid, received_ok) for rid in hit.victims}
        if any(e == "received_wrong" for e in endings.values()):
            verdict = "missed"
        elif any(e.startswith("integrity:") for e in endings.values()):
            verdict = "caught"
        elif any(e == "unknown" for e in endings.values()):
            verdict = "unresolved"  # a victim whose end nobody saw: not evidence of anything
        else:
            verdict = "absorbed"
        return Verdict(hit.fault, verdict, endings)

    def _ending(self, request_id: str, received_ok: Callable[[str], bool | None]) -> str:
        events = self.engine.events.for_request(request_id)
        aborted = [e["reason"] for e in events if e["kind"] == "aborted"]
        if aborted:
            reason = aborted[0]
            return f"integrity:{reason}" if reason in INTEGRITY_REASONS else f"aborted:{reason}"
        ok = received_ok(request_id)
        if ok is None:
            return "unknown"
        return "received_ok" if ok else "received_wrong"
