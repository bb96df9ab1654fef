"""Which armed faults took effect, whom they hit, and whether the fence caught each one.

A fault can fire and change nothing (no other page is held, no other row shares the batch), so a harness
judges effects, not firings. The contract is `FaultInjector.record(name, **detail)`, called by an
injection point when its fault changed something:

  fault                    call site                                   detail
  double_allocation        PageAllocator._take_page                    page, generation (the holders' one)
  stale_mapping            PageAllocator._free_a_held_page             page, generation
  cross_tenant_prefix_hit  PrefixCache._foreign_pages                  tenant (id), pages
  read_beyond_written      Scheduler._believe_unwritten_prefix         request_id, tokens
  stale_write              runner._redirect_a_write (via execute)      request_id (the writer), page

Until an engine file makes that call itself, `install_recorders` wraps the injection point so that it
does (a point whose module already calls `record("<fault>", ...)` is left alone). This shim is the only code
here that knows engine internals; delete it once every call site records.

`FaultLedger` listens on the engine thread and, for a page-level effect, notes the requests that map the
page at the generation it had: those are the ones the fence must stop. `verdicts` then judges each effect
from how its victims ended.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np

from kvfence.audit.faults import FaultEffect
from kvfence.cache import allocator as allocator_module
from kvfence.cache import prefix as prefix_module
from kvfence.cache.fence import INTEGRITY_REASONS, MappingRecord
from kvfence.engine import runner as runner_module
from kvfence.engine import scheduler as scheduler_module
from kvfence.engine.engine import LLMEngine
from kvfence.request import Request

SINGLE_NODE_FAULTS = (
    "stale_mapping",
    "double_allocation",
    "read_beyond_written",
    "cross_tenant_prefix_hit",
    "stale_write",
)
PAGE_FAULTS = frozenset({"double_allocation", "stale_mapping"})

# ---- the transitional shim ---------------------------------------------------------------------------------


def _records_itself(module: ModuleType, fault: str) -> bool:
    return re.search(rf"record\(\s*[\"']{fault}[\"']", inspect.getsource(module)) is not None


def _shim_double_allocation(engine: LLMEngine) -> None:
    allocator = engine.allocator
    take_page = allocator._take_page

    def recorded(record: MappingRecord) -> int:
        held_before = allocator.refcount.copy()
        page = take_page(record)
        if held_before[page] > 0:  # a page someone still held was handed out as if free
            generation = int(allocator.pool.generation[page])
            allocator.faults.record("double_allocation", page=page, generation=generation)
        return page

    allocator._take_page = recorded  # type: ignore[method-assign]


def _shim_stale_mapping(engine: LLMEngine) -> None:
    allocator = engine.allocator
    free_a_held_page = allocator._free_a_held_page

    def recorded() -> None:
        held_before = allocator.refcount.copy()
        free_a_held_page()
        for page in np.flatnonzero((held_before > 0) & (allocator.refcount == 0)).tolist():
            generation = int(allocator.pool.generation[page])
            allocator.faults.record("stale_mapping", page=page, generation=generation)

    allocator._free_a_held_page = recorded  # type: ignore[method-assign]


def _shim_cross_tenant_prefix_hit(engine: LLMEngine) -> None:
    prefix = engine.prefix
    if prefix is None:
        return
    foreign_pages = prefix._foreign_pages

    def recorded(tenant: int, count: int) -> list[int]:
        pages = foreign_pages(tenant, count)
        if pages:
            prefix.faults.record("cross_tenant_prefix_hit", tenant=tenant, pages=pages)
        return pages

    prefix._foreign_pages = recorded  # type: ignore[method-assign]


def _shim_read_beyond_written(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    believe = scheduler._believe_unwritten_prefix

    def recorded(request: Request, n: int) -> int:
        computed = believe(request, n)
        if computed != n:
            scheduler.faults.record("read_beyond_written", request_id=request.request_id, tokens=n - computed)
        return computed

    scheduler._believe_unwritten_prefix = recorded  # type: ignore[method-assign]


def _shim_stale_write(engine: LLMEngine) -> None:
    runner = engine.runner
    execute = runner.execute

    def recorded(requests: list[Request], num_new: list[int]) -> Any:
        fired = runner.faults.fired.get("stale_write", 0)
        result = execute(requests, num_new)
        # _redirect_a_write changes something exactly when another row (each maps >= 1 page) shares the
        # batch with row 0, whose first write it redirects.
        if runner.faults.fired.get("stale_write", 0) > fired and len(requests) >= 2:
            runner.faults.record("stale_write", request_id=requests[0].request_id)
        return result

    runner.execute = recorded  # type: ignore[method-assign]


_SHIMS: dict[str, tuple[ModuleType, Callable[[LLMEngine], None]]] = {
    "double_allocation": (allocator_module, _shim_double_allocation),
    "stale_mapping": (allocator_module, _shim_stale_mapping),
    "cross_tenant_prefix_hit": (prefix_module, _shim_cross_tenant_prefix_hit),
    "read_beyond_written": (scheduler_module, _shim_read_beyond_written),
    "stale_write": (runner_module, _shim_stale_write),
}


def install_recorders(engine: LLMEngine) -> list[str]:
    """Make every single-node injection point of `engine` record its effects; returns the faults shimmed.
    Call before the engine thread starts (or on it)."""
    shimmed = []
    for fault, (module, shim) in _SHIMS.items():
        if not _records_itself(module, fault):
            shim(engine)
            shimmed.append(fault)
    return shimmed


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
        """Shim the injection points that do not record yet, and listen (call before the engine runs)."""
        ledger = cls(engine)
        install_recorders(engine)
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
            # PrefixCache.lookup is called only while admitting the scheduler's first waiting request.
            waiting = self.engine.scheduler.waiting
            return [waiting[0].request_id] if waiting else []
        return []

    def verdicts(self, completed_ok: Callable[[str], bool | None]) -> list[Verdict]:
        """Judge every effect. `completed_ok(request_id)`: True when the request completed with its
        reference output, False when it completed with anything else, None when it did not complete."""
        return [self._judge(hit, completed_ok) for hit in self.hits]

    def _judge(self, hit: Hit, completed_ok: Callable[[str], bool | None]) -> Verdict:
        endings = {rid: self._ending(rid, completed_ok) for rid in hit.victims}
        if any(e == "completed_wrong" for e in endings.values()):
            verdict = "missed"
        elif any(e.startswith("integrity:") for e in endings.values()):
            verdict = "caught"
        elif any(e == "unknown" for e in endings.values()):
            verdict = "unresolved"  # a victim whose end nobody saw: not evidence of anything
        else:
            verdict = "absorbed"
        return Verdict(hit.fault, verdict, endings)

    def _ending(self, request_id: str, completed_ok: Callable[[str], bool | None]) -> str:
        events = self.engine.events.for_request(request_id)
        aborted = [e["reason"] for e in events if e["kind"] == "aborted"]
        if aborted:
            reason = aborted[0]
            return f"integrity:{reason}" if reason in INTEGRITY_REASONS else f"aborted:{reason}"
        ok = completed_ok(request_id)
        if ok is None:
            return "unknown"
        return "completed_ok" if ok else "completed_wrong"
