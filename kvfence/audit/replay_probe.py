"""One prompt of the replay check (replay.py): who sends it, its answer alone and its answers under load.

Contract: `Probe.send` sends one request of the probe (labelled by its stage) and marks a long probe's
canary on the exchange; `Probe.compare` names what an exchange is beside the solo answer: same, changed (a
200 unlike it, text or finish_reason), fenced (an integrity abort), no baseline, or the exchange's own
outcome. A module of its own so that the check (replay.py) and the confirmation (confirm.py) both read
probes without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfence.audit.client import Exchange, ProbeClient


@dataclass
class Probe:
    """One replay prompt: its tenant, its solo answer (None: no answer alone) and its answers under load.
    A `long` probe is a tenant's canary victim near the window (`planted`: its canary)."""

    index: int
    key_index: int
    endpoint: str
    prompt: str
    max_tokens: int
    planted: str | None = None
    solo: Exchange | None = None
    attempts: list[Exchange] = field(default_factory=list)  # every solo try, the answer last
    replays: list[Exchange] = field(default_factory=list)
    calibration: list[Exchange] = field(default_factory=list)  # answers in batches without churn
    busy: int = 0  # 503s under load, sent again
    logprobs: bool = False  # ask for each token's logprobs (the near-tie oracle reads them)

    @property
    def long(self) -> bool:
        return self.planted is not None

    def send(self, client: ProbeClient, stage: str) -> Exchange:
        """One request of this probe; `stage` (alone, load, batch) names it in the label."""
        label = f"replay:long-{stage}" if self.long else f"replay:{stage}"
        exchange = client.send(
            label, self.key_index, self.endpoint, self.prompt, self.max_tokens, logprobs=self.logprobs
        )
        exchange.planted = self.planted
        return exchange

    def compare(self, exchange: Exchange) -> str:
        """same | changed (a 200 unlike the solo answer) | fenced (integrity abort) | no baseline |
        the exchange's outcome (refused, aborted, dropped, broken)."""
        if exchange.fenced:
            return "fenced"
        if exchange.outcome != "answer":
            return exchange.outcome
        if self.solo is None:
            return "no baseline"
        same = (exchange.text, exchange.finish_reason) == (self.solo.text, self.solo.finish_reason)
        return "same" if same else "changed"
