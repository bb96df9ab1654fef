"""The tokens of an answer with their log-probabilities, as an OpenAI-compatible server reports them.

Contract: `read_steps(choice)` reads one choice (a whole one, or a streamed chunk's) in either of OpenAI's
shapes: chat's `logprobs.content` ([{token, logprob, top_logprobs: [{token, logprob}]}]) or legacy
completions' `logprobs` ({tokens, token_logprobs, top_logprobs: [{token: logprob}]}); it returns None
when the choice carries none (the server ignored or does not offer logprobs). Values that are not
numbers are refused (None), never trusted: this is untrusted input like any answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

TOP_LOGPROBS = 5  # the alternatives asked for at every step (OpenAI allows up to 20)


@dataclass(frozen=True)
class Step:
    """One generated token: its text, its log-probability, and the best alternatives' (token -> logprob,
    the token itself among them when the server lists it)."""

    token: str
    logprob: float
    top: dict[str, float] = field(default_factory=dict)

    def logprob_of(self, token: str) -> float | None:
        """`token`'s log-probability at this step where the server listed it, else None."""
        if token == self.token:
            return self.logprob
        return self.top.get(token)

    def bound(self) -> float:
        """A log-probability no unlisted token exceeds: the least listed one (the chosen token's if none)."""
        return min([self.logprob, *self.top.values()])


def logprobs_request(endpoint: str) -> dict[str, Any]:
    """The request fields that ask for TOP_LOGPROBS alternatives at every step."""
    if endpoint == "chat":
        return {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
    return {"logprobs": TOP_LOGPROBS}


def read_steps(choice: dict[str, Any]) -> list[Step] | None:
    """The steps a choice reports (see the module doc), None when it reports none or they are malformed."""
    logprobs = choice.get("logprobs")
    if not isinstance(logprobs, dict):
        return None
    try:
        if isinstance(logprobs.get("content"), list):
            return [_chat_step(item) for item in logprobs["content"]]
        tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
        if isinstance(tokens, list) and isinstance(values, list) and len(tokens) == len(values):
            tops = logprobs.get("top_logprobs") or [{}] * len(tokens)
            return [
                Step(str(t), _number(v), {str(k): _number(x) for k, x in (top or {}).items()})
                for t, v, top in zip(tokens, values, tops, strict=False)
            ]
    except (TypeError, ValueError, AttributeError):
        return None
    return None


def _chat_step(item: dict[str, Any]) -> Step:
    top = {str(alt["token"]): _number(alt["logprob"]) for alt in item.get("top_logprobs") or []}
    return Step(str(item["token"]), _number(item["logprob"]), top)


def _number(value: object) -> float:
    """A log-probability (<= 0, or a rounding above it; -inf allowed); ValueError for anything else (NaN,
    +inf, a clearly positive number, text, None)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"not a log-probability: {value!r}")
    number = float(value)
    if math.isnan(number) or number > 1e-3:
        raise ValueError(f"not a log-probability: {value!r}")
    return number
