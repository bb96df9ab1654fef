"""Named fault injection points (docs/fence.md: "How the fence works"). Every point is off unless
explicitly armed.

A fault simulates one bookkeeping bug. Arming it never disables a protection: the fence must catch what
the fault does, and tests prove that by running the same fault with isolation off (the leak) and on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FAULTS = frozenset(
    {
        # single node
        "stale_mapping",
        "double_allocation",
        "read_beyond_written",
        "cross_tenant_prefix_hit",
        "stale_write",
        "read_rejected_draft",
        "tier_foreign_write",
        # prefill/decode transfer
        "placeholder_transfer",
        "partial_transfer",
        "late_write_after_cancel",
        "corrupt_page",
        "transfer_failure_ack_mismatch",
        "abort_mid_transfer",
        "worker_crash_mid_transfer",
    }
)


@dataclass
class _Arming:
    rate: float
    remaining: int | None  # None: unlimited


@dataclass(frozen=True)
class FaultEffect:
    """What one fired fault actually did: `detail` names whom it hit (a request id, a page, a generation)."""

    fault: str
    detail: dict[str, Any] = field(default_factory=dict)


class FaultInjector:
    """`fire(name)` answers whether an armed fault triggers now. Unarmed points always answer False.

    A fault can fire and change nothing (no page to steal, no other row to write into). An injection point
    whose fault did take effect says so with `record(name, **detail)`, so a harness can demand that every
    effect was caught, not every firing."""

    def __init__(self, seed: int = 0) -> None:
        self._armed: dict[str, _Arming] = {}
        self._rng = random.Random(seed)
        self.fired: dict[str, int] = {}
        self.effects: list[FaultEffect] = []
        # Called with each effect as it is recorded, on the recording (engine) thread: a harness resolves
        # there whom a page-level effect hit, while the pages' holders still hold them.
        self.listeners: list[Callable[[FaultEffect], None]] = []

    def arm(self, name: str, rate: float = 1.0, times: int | None = None) -> None:
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}")
        if not 0 < rate <= 1:
            raise ValueError("fault rate must be in (0, 1]")
        self._armed[name] = _Arming(rate, times)

    def fire(self, name: str) -> bool:
        arming = self._armed.get(name)
        if arming is None or arming.remaining == 0 or self._rng.random() >= arming.rate:
            return False
        if arming.remaining is not None:
            arming.remaining -= 1
        self.fired[name] = self.fired.get(name, 0) + 1
        return True

    def record(self, name: str, **detail: Any) -> None:
        """An injection point's fault `name` took effect; `detail` (JSON-able) names whom it hit."""
        if name not in FAULTS:
            raise ValueError(f"unknown fault {name!r}")
        effect = FaultEffect(name, detail)
        self.effects.append(effect)
        for listener in self.listeners:
            listener(effect)


def parse_fault_spec(spec: str) -> tuple[str, float]:
    """'NAME' or 'NAME:RATE' (as given to --inject-fault)."""
    name, _, rate = spec.partition(":")
    return name, float(rate) if rate else 1.0
