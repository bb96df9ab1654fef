"""Draft tokens for speculative decoding: what a request's next tokens probably are, proposed for the model
to verify in one forward over them (runner.py) and accepted only where the target itself picks them.

Contract: `Drafter.propose(request, k)` returns at most `k` token ids that follow the request's tokens
(its prompt and output so far), possibly none; a proposal is only a guess, so a wrong one costs compute,
never output. A drafter that computes its proposals (draft_model.py) does so for a whole step at once in
`prepare`, before the step's proposals are asked for; `forget` drops what it keeps of a request that left,
and `take_violations` hands the engine the requests whose draft state the fence refused (it aborts them).
`SpecStats` counts what verification kept.

`NgramDrafter` is vLLM's prompt lookup ("ngram"): find the longest suffix of the tokens, between
`prompt_lookup_min` and `prompt_lookup_max` long, that occurred earlier in them, and propose the `k` tokens
that followed its latest earlier occurrence. Where those run into the end of the tokens (the match is fewer
than `k` tokens back: a loop), the draft goes on around the loop, as the match says it repeats.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class Drafted(Protocol):
    """What a drafter reads of a request."""

    request_id: str
    tenant: str

    @property
    def all_token_ids(self) -> list[int]: ...


class Drafter(ABC):
    """Proposes draft tokens for one request at a time."""

    def prepare(self, wants: Sequence[tuple[Drafted, int]]) -> None:
        """A step is about to ask for up to `k` drafts of each (request, k): compute them now, together.
        Nothing for a drafter whose proposals cost no model."""
        return None

    @abstractmethod
    def propose(self, request: Drafted, k: int) -> list[int]:
        """At most `k` tokens guessed to follow the request's tokens."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept of it (nothing, by default)."""
        return None

    def take_violations(self) -> dict[str, str]:
        """Requests whose draft state the fence refused, by id, with the reason, since the last call."""
        return {}


class NgramDrafter(Drafter):
    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        assert 1 <= lookup_min <= lookup_max
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, request: Drafted, k: int) -> list[int]:
        tokens = request.all_token_ids
        if k < 1 or len(tokens) <= self.lookup_min:
            return []
        seq = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.lookup_max, len(seq) - 1), self.lookup_min - 1, -1):
            start = _latest_earlier_match(seq, n)
            if start is not None:
                loop = seq[start + n :]  # what followed the match, up to now: repeats if the match is a loop
                return np.resize(loop, k).tolist()
        return []


def _latest_earlier_match(seq: np.ndarray, n: int) -> int | None:
    """The start of the latest occurrence of `seq`'s last `n` tokens ending before `seq` does, else None."""
    windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
    hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
    return int(hits[-1]) if hits.size else None


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: verifications of at least one draft (`drafts`), the draft tokens they
    verified, those accepted, and accepted ones by position (index i: the (i+1)-th draft of a row)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def count(self, drafted: int, accepted: int) -> None:
        """One row's verification: `drafted` drafts, the first `accepted` of them kept."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position.extend([0] * (drafted - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1
