"""The near-tie oracle: is a greedy answer that changed under load explained by the server's numerics?

Batch-dependent rounding moves a logit by about 1e-5 (float32 CPU) to 1e-2 (bf16 GPU), so it can flip a
greedy token only where the solo run's top two were that close. A change where the solo run was sure is
a different context: stale, foreign or missing KV.

Contract:
- `departure(solo, other)` finds the first step where an answer departs from its solo answer and how sure
  the solo run was there: its chosen token's log-probability minus the other token's (a logit gap: both
  share one normaliser), or a lower bound on it when the other token is not among the solo step's listed
  alternatives.
- `jitter(solo, other)` is the largest log-probability difference the two report for the same token at
  the same step, over the steps before any departure: the server's own rounding, seen where the contexts
  agree.
- `Margin.measured(jitters)` is JITTER_FACTOR x the largest jitter, never under FLOOR and never over
  CEILING: the ceiling holds a server whose batched answers disagree with its solo ones far beyond any
  rounding to a margin that still fails a sure departure (a faulty server must not calibrate its own
  faults away).
- `Margin.judge(departure)`: "beyond" (the solo run was surer than the margin: FAIL), "explained" (a
  near-tie within it) or "undecided" (the steps do not say: an answer that ends where the other goes on).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfence.audit.tokens import Step

JITTER_FACTOR = 10.0
FLOOR = 0.02  # nats: no departure is called numeric noise with a smaller margin than this
CEILING = 1.0  # nats: nor with a larger one, whatever the calibration measured


@dataclass(frozen=True)
class Departure:
    """Where an answer first departs from its solo answer (`step`), the two tokens there (None: that answer
    ended), and the solo run's `gap` between them (`exact` False: a lower bound)."""

    step: int
    solo_token: str | None
    other_token: str | None
    gap: float | None
    exact: bool

    def describe(self) -> str:
        if self.gap is None:
            return f"step {self.step}: {self.solo_token!r} alone, {self.other_token!r} here (no gap known)"
        bound = "" if self.exact else ">= "
        return (
            f"step {self.step}: {self.other_token!r} where the solo run chose {self.solo_token!r} by "
            f"{bound}{self.gap:.3g} nats"
        )


def departure(solo: Sequence[Step], other: Sequence[Step]) -> Departure | None:
    """The first step where `other` departs from `solo`; None for the same tokens."""
    for step, (mine, theirs) in enumerate(zip(solo, other, strict=False)):
        if mine.token != theirs.token:
            listed = mine.logprob_of(theirs.token)
            if listed is not None:
                return Departure(step, mine.token, theirs.token, mine.logprob - listed, True)
            return Departure(step, mine.token, theirs.token, mine.logprob - mine.bound(), False)
    if len(solo) == len(other):
        return None
    step = min(len(solo), len(other))  # one answer ends here (a stop token is not a listed step)
    solo_token = solo[step].token if step < len(solo) else None
    other_token = other[step].token if step < len(other) else None
    return Departure(step, solo_token, other_token, None, False)


def jitter(solo: Sequence[Step], other: Sequence[Step]) -> float:
    """The largest difference in log-probability of one token at one step, before any departure."""
    found = 0.0
    for mine, theirs in zip(solo, other, strict=False):
        if mine.token != theirs.token:
            break
        pairs = [(mine.logprob, theirs.logprob)]
        pairs += [(value, theirs.top[token]) for token, value in mine.top.items() if token in theirs.top]
        found = max([found, *(abs(a - b) for a, b in pairs)])
    return found


@dataclass(frozen=True)
class Margin:
    """The gap below which a departure is explained by rounding, and how it was set."""

    value: float
    jitter: float
    samples: int  # answers the jitter was measured over

    @classmethod
    def measured(cls, jitters: Iterable[float]) -> Margin:
        seen = list(jitters)
        worst = max(seen, default=0.0)
        return cls(min(CEILING, max(FLOOR, JITTER_FACTOR * worst)), worst, len(seen))

    def judge(self, found: Departure) -> str:
        if found.gap is None:
            return "undecided"
        return "beyond" if found.gap > self.value else "explained"

    def describe(self) -> str:
        rule = f"{JITTER_FACTOR:g} x the largest jitter {self.jitter:.2g}, within [{FLOOR:g}, {CEILING:g}]"
        return f"margin {self.value:.3g} nats ({rule}; over {self.samples} answers in calibration batches)"

    def evidence(self) -> dict[str, Any]:
        return {
            "margin_nats": self.value,
            "jitter_nats": self.jitter,
            "calibration_answers": self.samples,
            "factor": JITTER_FACTOR,
            "floor": FLOOR,
            "ceiling": CEILING,
        }
