"""A decode worker's view of one transfer into its pages: one explicit state machine.

    GRANTED ──a page, `complete` or a notification──▶ RECEIVING ──one-sided `complete`──▶ COMPLETING
       │                                                  │                                   │
       └──────────── aborted while writes may still land ─┴──────────▶ QUARANTINED ◀──────────┘

Contract:
- `to` allows only the arrows above; anything else raises `TransferStateError` (a bug, never a peer's
  doing: peers' messages are checked before they move a transfer).
- A transfer leaves the table in one of three ways, owned by the decode worker: resumed (RECEIVING or
  COMPLETING, after the handoff check), released (GRANTED and nothing can have been written into it), or
  drained (QUARANTINED: the prefill's abort-ack, the loss of its link, or the quarantine deadline).
- `due`: what its deadlines say is owed now: a quarantine older than `quarantine_s` expires, a one-sided
  grant naming a landing process since replaced is void, a live phase without progress for `timeout_s`
  times out. Nothing waits on a peer without a deadline, so no peer can hold pages forever.
- A one-sided grant may be written from the moment its key is sent, before any message arrives
  (`may_be_written`): its timeout quarantines, never releases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from kvfence.disagg.messages import Complete

MAX_NOTIFIERS = 4  # agents remembered per transfer: the assigned one, plus a few forged ones to count


class Phase(Enum):
    GRANTED = "granted"  # pages reserved and granted; nothing from the assigned prefill yet
    RECEIVING = "receiving"  # a page, `complete` or a WRITE's notification came
    COMPLETING = "completing"  # one-sided: `complete` came, the WRITE's notification from its agent not yet
    QUARANTINED = "quarantined"  # aborted while writes may still land: no read, no write, no reuse


NEXT = {
    Phase.GRANTED: {Phase.RECEIVING, Phase.COMPLETING, Phase.QUARANTINED},
    Phase.RECEIVING: {Phase.COMPLETING, Phase.QUARANTINED},
    Phase.COMPLETING: {Phase.QUARANTINED},
    Phase.QUARANTINED: set(),
}


class TransferStateError(RuntimeError):
    """A transition the state machine does not have."""


@dataclass
class Inbound:
    router: str
    prefill: str
    since: float  # when the phase began, or the last progress in it
    grant: list[tuple[int, int]] = field(default_factory=list)  # the (page, generation) targets granted
    key: bytes = b""  # one-sided: what its sealed pages open with
    incarnation: int = -1  # one-sided: the landing process whose area the grant names
    phase: Phase = Phase.GRANTED
    notifiers: set[str] = field(default_factory=set)  # one-sided: agents whose notification named it
    complete: Complete | None = None  # one-sided: `complete` that waits for its agent's notification

    def to(self, phase: Phase, now: float) -> None:
        if phase not in NEXT[self.phase]:
            raise TransferStateError(f"{self.phase.name} -> {phase.name}")
        self.phase, self.since = phase, now

    def progress(self, now: float) -> None:
        """Something came from the assigned prefill: the transfer has begun (or goes on)."""
        if self.phase is Phase.GRANTED:
            self.to(Phase.RECEIVING, now)
        else:
            self.since = now

    def notified_by(self, agent: str) -> None:
        if len(self.notifiers) < MAX_NOTIFIERS:
            self.notifiers.add(agent)

    @property
    def may_be_written(self) -> bool:
        return self.phase is not Phase.GRANTED or bool(self.key)

    def due(self, now: float, timeout_s: float, quarantine_s: float, incarnation: int | None) -> str | None:
        """`quarantine_expired`, `landing_restarted` (`incarnation`: the landing process serving now, None
        without one), `transfer_timeout`, or None."""
        if self.phase is Phase.QUARANTINED:
            return "quarantine_expired" if now - self.since > quarantine_s else None
        if self.key and incarnation is not None and incarnation != self.incarnation:
            return "landing_restarted"
        return "transfer_timeout" if now - self.since > timeout_s else None
