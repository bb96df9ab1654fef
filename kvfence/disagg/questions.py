"""The questions a router has asked its workers, and the only replies that answer them.

A reply is taken only as the answer to an open question that this router asked that very worker, of the
reply's kind, carrying the question's token; anything else is unsolicited (the caller drops and counts it).
A question is either awaited (a caller blocks on its future until the reply or a timeout, then closes it)
or unawaited (the hello sent when a worker's link comes back up: the I/O thread handles its reply itself).

Tokens are opened by callers' threads and taken by the router's I/O thread; a dict's single get, set and
pop are atomic in CPython, and a token is never reused, so no lock is needed.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from enum import Enum

from kvfence.disagg.messages import Msg


class Answered(Enum):
    UNSOLICITED = "unsolicited"  # no open question of this worker's has this token and kind
    AWAITED = "awaited"  # the asker's future has the reply
    UNAWAITED = "unawaited"  # the question is closed; the reply is the caller's to handle


class Questions:
    def __init__(self) -> None:
        # token -> (the worker asked, the reply kind, the future awaiting it; None when unawaited)
        self._open: dict[str, tuple[str, str, concurrent.futures.Future[Msg] | None]] = {}
        self._tokens = itertools.count()

    def ask(self, peer: str, kind: str) -> tuple[str, concurrent.futures.Future[Msg]]:
        """Open an awaited question to `peer`, answered by a reply of `kind`; the caller must `close` it
        once it has the reply or gave up."""
        token = f"q{next(self._tokens)}"
        future: concurrent.futures.Future[Msg] = concurrent.futures.Future()
        self._open[token] = (peer, kind, future)
        return token, future

    def ask_unawaited(self, peer: str, kind: str) -> str:
        """Open a question whose reply the I/O thread handles itself (`take` says UNAWAITED and closes it)."""
        token = f"re{next(self._tokens)}"
        self._open[token] = (peer, kind, None)
        return token

    def pending(self) -> list[tuple[str, str]]:
        """Each open question's worker and reply kind, oldest first."""
        return [(peer, kind) for peer, kind, _ in list(self._open.values())]

    def close(self, token: str) -> None:
        self._open.pop(token, None)

    def fail(self, token: str, error: Exception) -> None:
        """The question could not be sent: it is closed, and an awaiting asker gets `error` now rather than
        at its timeout."""
        asked = self._open.pop(token, None)
        future = None if asked is None else asked[2]
        if future is not None and not future.done():
            future.set_exception(error)

    def take(self, sender: str, token: str, reply: Msg) -> Answered:
        """Whether `reply`, from `sender`, answers an open question, and which kind of question."""
        asked = self._open.get(token)
        if asked is None or asked[:2] != (sender, reply.KIND):
            return Answered.UNSOLICITED
        future = asked[2]
        if future is None:
            del self._open[token]
            return Answered.UNAWAITED
        if future.done():  # a second reply to one question: a replay, not an answer
            return Answered.UNSOLICITED
        future.set_result(reply)
        return Answered.AWAITED
