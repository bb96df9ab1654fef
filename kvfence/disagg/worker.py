"""The loop shared by prefill and decode workers: one thread handles messages and steps the engine.

Keeping both on one thread means no lock is ever needed around the engine, the pool or the fence: a
message is handled completely (pages written, records checked) between two model steps.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvfence.disagg.connector import Connector, Message
from kvfence.disagg.handoff import HandoffEngine
from kvfence.engine.info import engine_info
from kvfence.engine.stats import EngineStats

log = logging.getLogger("kvfence.disagg")


class Worker:
    role = "worker"

    def __init__(self, engine: HandoffEngine, connector: Connector) -> None:
        self.engine = engine
        self.connector = connector
        self.stopped = threading.Event()

    def serve_forever(self) -> None:
        while not self.stopped.is_set():
            self.run_once(timeout_s=0.0 if self.engine.has_unfinished() else 0.05)

    def run_once(self, timeout_s: float = 0.0) -> None:
        """Handle every message waiting (the first may be waited for), then one engine step."""
        received = self.connector.recv(timeout_s)
        while received is not None:
            self._handle(*received)
            received = self.connector.recv(0.0)
        if self.engine.has_unfinished():
            self.after_step(self.engine.safe_step())
        self.tick(time.monotonic())

    def _handle(self, sender: str, message: Message) -> None:
        """One message; a handler that raises (a malformed message) fails only the request it names."""
        try:
            getattr(self, f"on_{message.kind}", self.on_unknown)(sender, message)
        except Exception:
            log.exception("%s: bad %r message from %s", self.role, message.kind, sender)
            request_id = message.fields.get("request_id")
            if isinstance(request_id, str):
                self.fail_request(request_id, "bad_message")

    def fail_request(self, request_id: str, reason: str) -> None:
        """Role hook: end one request after an error handling its messages."""
        self.engine.abort(request_id, reason)

    def after_step(self, outputs: list[Any]) -> None:
        """Role hook: what the step produced (tokens on decode, finished prefills on prefill)."""

    def tick(self, now: float) -> None:
        """Role hook: time-driven work (transfer deadlines)."""

    def reply(self, peer: str, kind: str, **fields: Any) -> None:
        self.connector.send(peer, Message(kind, fields))

    # ---- control messages every worker answers ----------------------------------------------------------

    def on_hello(self, sender: str, message: Message) -> None:
        engine = self.engine
        self.reply(
            sender,
            "hello_reply",
            token=message.fields.get("token"),
            role=self.role,
            capacity_tokens=engine.capacity.capacity_tokens,
            max_model_len=engine.max_model_len,
            page_size=engine.pool.page_size,
            isolation=engine.fence.enabled,
            info=engine_info(engine),
        )

    def on_stats(self, sender: str, message: Message) -> None:
        self.reply(
            sender,
            "stats_reply",
            token=message.fields.get("token"),
            stats=EngineStats.read(self.engine).to_dict(),
        )

    def on_audit(self, sender: str, message: Message) -> None:
        request_id = message.fields["request_id"]
        self.reply(
            sender,
            "audit_reply",
            token=message.fields.get("token"),
            request_id=request_id,
            events=[{**e, "where": self.role} for e in self.engine.events.for_request(request_id)],
        )

    def on_peer_up(self, sender: str, message: Message) -> None:
        """Connection events matter only to a decode worker (its prefill peers)."""

    def on_peer_down(self, sender: str, message: Message) -> None:
        """Connection events matter only to a decode worker (its prefill peers)."""

    def on_error(self, sender: str, message: Message) -> None:
        log.warning("%s: error from %s: %s", self.role, sender, message.fields.get("message"))

    def on_unknown(self, sender: str, message: Message) -> None:
        self.reply(sender, "error", message=f"unknown message kind {message.kind!r}")
