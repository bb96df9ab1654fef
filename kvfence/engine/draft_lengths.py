"""Adaptive draft length: how many drafts each request verifies next, from its own acceptance so far.

Why: a draft costs a verification row whether it is kept or not, and requests differ (one copies its
prompt and keeps nearly every draft, another keeps none), so a length fixed for all wastes rows on the
second and under-drafts the first once it has been cut. Where the length comes from does not change the
output: every verified position is sampled from the target after the tokens before it (runner.py), so
greedy output is what decoding alone gives and sampled output keeps its distribution whatever the length.

Contract: `DraftLengths(limit)`; `length(request_id, position)` is in [0, limit] (`position`: the tokens the
request has output so far). A request not yet recorded gets `limit`. `record(request_id, position, drafted,
accepted)` after a verification of `drafted` >= 1 drafts that kept the first `accepted`:
- all kept: the length grows by one (at most `limit`), and never falls below what was just verified + 1;
- some kept: the length becomes accepted + 1 (the kept run, and one more to find where it ends);
- none kept: the length halves; at 0 the request decodes alone for a pause (1 token, doubled at each
  probe that fails, at most MAX_PAUSE), then probes with one draft; a kept draft ends the pause.
`forget(request_id)` drops a request's state (it left).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_PAUSE = 64  # tokens: a request that never keeps a draft spends at most 1 row in 65 on one


@dataclass
class _State:
    length: int
    pause: int = 1  # tokens decoded alone after the next probe that fails
    resume_at: int = 0  # the output position from which a paused request (length 0) probes again


class DraftLengths:
    def __init__(self, limit: int) -> None:
        assert limit >= 1
        self.limit = limit
        self._states: dict[str, _State] = {}

    def length(self, request_id: str, position: int) -> int:
        """Drafts the request may verify at output `position`."""
        state = self._states.get(request_id)
        if state is None:
            return self.limit
        if state.length == 0:
            return 1 if position >= state.resume_at else 0
        return state.length

    def record(self, request_id: str, position: int, drafted: int, accepted: int) -> None:
        """A verification at output `position` of `drafted` drafts kept the first `accepted` of them."""
        assert 0 <= accepted <= drafted and drafted >= 1
        state = self._states.setdefault(request_id, _State(self.limit))
        if accepted == drafted:
            state.length = min(self.limit, max(state.length, drafted) + 1)
            state.pause = 1
        elif accepted > 0:
            state.length = accepted + 1
            state.pause = 1
        else:
            state.length = min(state.length, drafted) // 2
            if state.length == 0:  # this step's token is at `position`: decode `pause` more alone
                state.resume_at = position + 1 + state.pause
                state.pause = min(2 * state.pause, MAX_PAUSE)

    def forget(self, request_id: str) -> None:
        self._states.pop(request_id, None)
