"""The front door against slow clients: a connection must send a complete request head within the read
timeout, and a request body that sends nothing for that long is cut; at most `max_connections` are served
at once (uvicorn's `limit_concurrency`: a request beyond it gets 503), a new one taking the place of the
one that has waited longest for its request head.

uvicorn has no header-read timeout of its own: a client trickling one header byte every few seconds holds
its connection forever. `ReadTimeoutH11Protocol` is uvicorn's h11 protocol with one timer per connection,
armed for what the server is waiting for from the client:

- the request head (the connection is new, or its previous response is complete): a deadline, not reset by
  progress, so a trickle cannot stretch it;
- the request body: reset by every byte that arrives, so only a stall is cut, never a long upload;
- nothing (the app is working or answering): no timer, however long a generation takes.

When it fires the transport is closed, without a response (as uvicorn's own keep-alive timeout does); a
handler waiting for the body sees a disconnect. A timer that fires while uvicorn itself paused reading (its
body buffer is full because the app is slow to consume it) waits again: that stall is ours, not the client's.

A connection that has not sent a complete request head has shown no key: it holds a place but is owed
none. When a new connection finds every place taken, the connection that has waited longest for its head
(a partial head, or an idle keep-alive) is closed to make room, so clients holding partial heads cannot
crowd out the ones that send requests (issue 27: ~1,100 keyless partial heads, refreshed every 8 s, made
every request a 503). Only connections with a request in flight or an answer going out fill the cap for
good; past them, uvicorn's 503 stands.

`uvicorn_config` builds the Config both the CLI (`kvfence serve`, `kvfence router`) and the test harness use.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_READ_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024


class ReadTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read timeout on the request head and on a stalled body. Use a subclass
    made by `protocol_class`, which sets `read_timeout_s`."""

    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._awaiting: str | None = None  # "head", "body", or None: what the timer is armed for
        self._awaiting_since = 0.0  # loop time the current wait began

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch(progress=False)
        # Connections closed in this loop turn are still in the set: they do not count, nor go twice.
        live = [c for c in self.connections if not c.transport.is_closing()]
        if len(live) >= self.max_connections:  # uvicorn would answer the next request 503
            self._evict_one(live)

    def _evict_one(self, live: list[H11Protocol]) -> None:
        """Close the other connection that has waited longest for a request head, if any does."""
        waiting = [
            c
            for c in live
            if c is not self and isinstance(c, ReadTimeoutH11Protocol) and c._awaiting == "head"
        ]
        if waiting:
            oldest = min(waiting, key=lambda c: c._awaiting_since)
            self.logger.debug("closing %s: its place went to a new connection", oldest.client)
            oldest._cancel_read_timer()
            oldest.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch(progress=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch(progress=False)  # keep-alive: the next request head is now awaited

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _watch(self, progress: bool) -> None:
        """Arm, keep or cancel the timer for what the connection now awaits from the client."""
        if self.transport.is_closing():
            self._cancel_read_timer()
            return
        state = self.conn.their_state
        awaiting = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if awaiting != self._awaiting or (awaiting == "body" and progress):
            self._cancel_read_timer()
            self._awaiting_since = self.loop.time()
            if awaiting is not None:
                self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
        self._awaiting = awaiting

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # uvicorn stopped reading (the app is slow to take the body): not a stall
            self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)
            return
        self.logger.debug(
            "closing %s: waited %.1fs for the request %s", self.client, self.read_timeout_s, self._awaiting
        )
        self.transport.close()


def protocol_class(
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S, max_connections: int = DEFAULT_MAX_CONNECTIONS
) -> type[ReadTimeoutH11Protocol]:
    """The protocol class for uvicorn's `http=` setting, with this read timeout and connection cap."""
    if read_timeout_s <= 0:
        raise ValueError(f"read_timeout_s must be positive, got {read_timeout_s}")
    settings = {"read_timeout_s": read_timeout_s, "max_connections": max_connections}
    return type(ReadTimeoutH11Protocol.__name__, (ReadTimeoutH11Protocol,), settings)


def uvicorn_config(
    app: Any,
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    **kwargs: Any,
) -> uvicorn.Config:
    """A uvicorn Config for `app` behind the front door: the read timeouts and the connection cap."""
    if max_connections < 1:
        raise ValueError(f"max_connections must be positive, got {max_connections}")
    # asyncio's own loop, whatever else is installed: uvicorn's "auto" takes uvloop where it is (ray[serve]
    # brings it), and under uvloop a wave of held heads beyond the cap got 503 before the front door closed
    # the oldest (tests/integration/test_front_door.py), which asyncio's loop does not.
    kwargs.setdefault("loop", "asyncio")
    return uvicorn.Config(
        app,
        http=protocol_class(read_timeout_s, max_connections),
        ws="none",  # no endpoint speaks WebSocket: an upgrade is answered as plain HTTP, its library unloaded
        limit_concurrency=max_connections,
        **kwargs,
    )
