"""The loop shared by prefill and decode workers: one thread handles messages and steps the engine.

Keeping both on one thread means no lock is ever needed around the engine, the pool or the fence: a
message is handled completely (pages written, records checked) between two model steps.

Every frame is untrusted until `_handle` has parsed it (`messages.decode`: declared type, bounds) and
checked that the authenticated sender's role may send that kind to this role (`messages.ROLE_RULES`).
Anything else is dropped, counted by reason (`transport_rejected` in the stats, `/metrics`) and logged
with the authenticated sender; no frame can end the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from typing import Any

from kvfence.disagg.connector import Connector, LinkEvent, Received
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.messages import (
    Audit,
    AuditReply,
    BadMessage,
    Bounds,
    Hello,
    HelloReply,
    Msg,
    Stats,
    StatsReply,
    accept,
)
from kvfence.disagg.nixl_transport import OneSidedAgent
from kvfence.engine.info import engine_info
from kvfence.engine.stats import EngineStats

IDLE_WAIT_S = 0.05  # an idle worker's longest wait on its socket: how soon it ticks (deadlines, NIXL polls)

log = logging.getLogger("kvfence.disagg")


class Worker:
    role = "worker"
    agent: OneSidedAgent | None = None  # set by a worker that moves KV with one-sided NIXL writes

    def __init__(self, engine: HandoffEngine, connector: Connector) -> None:
        self.engine = engine
        self.connector = connector
        self.stopped = threading.Event()
        # Frames are bounded by what the model could ever take; this pool's own limits are admission's, which
        # answers with a proper refusal.
        self.bounds = Bounds(engine.model.config.context_length, engine.model.config.vocab_size)
        self.rejected: Counter[str] = Counter()  # frames dropped after receipt, by reason
        self._failing: set[str] = set()  # requests being failed because a message of theirs was dropped

    def serve_forever(self) -> None:
        while not self.stopped.is_set():
            self.run_once(timeout_s=self.wait_s())

    def busy(self) -> bool:
        """Work waits that is not a message (a step to run, a transfer to poll): do not sleep on recv."""
        return self.engine.has_unfinished()

    def wait_s(self) -> float:
        """How long the next receive may wait for a frame: not at all while `busy`."""
        return 0.0 if self.busy() else IDLE_WAIT_S

    def run_once(self, timeout_s: float = 0.0) -> None:
        """Handle every frame waiting (the first may be waited for), then one engine step."""
        received = self.connector.recv(timeout_s)
        while received is not None:
            self.handle(received)
            received = self.connector.recv(0.0)
        if self.engine.has_unfinished():
            self.after_step(self.engine.safe_step())
        if self.agent is not None:
            self.agent.check()
        self.tick(time.monotonic())

    def handle(self, item: Received | LinkEvent) -> None:
        """One frame or link event. Parsing and the role check come first; a handler that still raises
        fails only the request its (authenticated, well-formed) message names."""
        if isinstance(item, LinkEvent):
            self.on_link(item)
            return
        try:
            message = accept(item.header, item.payload, item.role, self.role, self.bounds)
        except BadMessage as exc:
            self.drop(item.sender, exc.reason, str(exc))
            return
        except Exception:  # a parser bug must not end the worker: the frame is dropped all the same
            log.exception("%s: parsing a frame from %s failed", self.role, item.sender)
            self.drop(item.sender, "parse_error", "the parser failed")
            return
        try:
            getattr(self, f"on_{message.KIND}")(item.sender, message)
        except Exception:
            log.exception("%s: %r message from %s failed", self.role, message.KIND, item.sender)
            request_id = getattr(message, "request_id", None)
            if isinstance(request_id, str):
                self.fail_request(request_id, "bad_message")

    def is_peer(self, address: str, role: str) -> bool:
        """Whether a message may name `address` as the `role` worker: with keys, only a configured peer of
        that role (a worker never dials an address it was merely told); without keys, any."""
        return not self.connector.secure or self.connector.role_of(address) == role

    def drop(self, sender: str, reason: str, detail: str) -> None:
        """Refuse a frame: counted by reason and logged with who sent it; nothing else changes."""
        self.rejected[reason] += 1
        log.warning("%s: dropped a frame from %s (%s): %s", self.role, sender, reason, detail)

    def kv_refusal(self) -> str | None:
        """Why this worker takes no KV now (its one-sided agent gave up restarting: it fails closed
        rather than loop), or None."""
        if self.agent is not None and self.agent.given_up:
            return "its landing process failed too many times in a row and is not restarted"
        return None

    def fail_request(self, request_id: str, reason: str) -> None:
        """Role hook: end one request after an error handling its messages."""
        self.engine.abort(request_id, reason)

    def after_step(self, outputs: list[Any]) -> None:
        """Role hook: what the step produced (tokens on decode, finished prefills on prefill)."""

    def tick(self, now: float) -> None:
        """Role hook: time-driven work (transfer deadlines)."""

    def reply(self, peer: str, message: Msg) -> bool:
        """Send, never blocking. A message the connector dropped (its peer takes no frames: counted as
        `send_blocked`) fails the request it is for at once (`fail_request`), not at a peer's deadline;
        once per request, however many of its messages that failure drops in turn. Whether it was sent."""
        if self.connector.send(peer, message):
            return True
        request_id = getattr(message, "request_id", None)
        if isinstance(request_id, str) and request_id not in self._failing:
            self._failing.add(request_id)
            try:
                self.fail_request(request_id, "send_blocked")
            finally:
                self._failing.discard(request_id)
        return False

    def on_link(self, event: LinkEvent) -> None:
        """Role hook: this worker's own connection to a peer came up or went down."""

    # ---- control messages every worker answers (from the router only) ----------------------------------

    def on_hello(self, sender: str, message: Hello) -> None:
        engine = self.engine
        self.reply(
            sender,
            HelloReply(
                token=message.token,
                role=self.role,
                capacity_tokens=engine.capacity.capacity_tokens,
                max_model_len=engine.max_model_len,
                page_size=engine.pool.page_size,
                isolation=engine.fence.enabled,
                info={**engine_info(engine), "transport": self.transport()},
            ),
        )

    def transport(self) -> dict[str, Any]:
        """How this worker's transport is protected, for /v1/audit/info."""
        secure = self.connector.secure
        if self.agent is None:  # pages as ZeroMQ frames, on the CURVE channel itself
            return {"kind": "zeromq", "kv": "zmq", "authenticated": secure, "data_plane_sealed": secure}
        # One-sided: what UCX reaches, and how what it carries is sealed. Sealed only when every condition
        # holds, each observed now (a landing process that was replaced, or made itself dumpable, shows).
        plane = self.agent.describe()
        conditions = {
            "landing_process": plane.get("agent") == "landing process" and not plane.get("pool_registered"),
            **plane.get("conditions", {}),
            "curve": secure,
        }
        return {
            "kind": "zeromq",
            "kv": "nixl",
            "authenticated": secure,
            "data_plane_sealed": all(conditions.values()),
            **plane,
            "conditions": conditions,
        }

    def on_stats(self, sender: str, message: Stats) -> None:
        stats = EngineStats.read(self.engine, self.rejected + self.connector.rejected)
        self.reply(sender, StatsReply(token=message.token, stats=stats.to_dict()))

    def on_audit(self, sender: str, message: Audit) -> None:
        events = [{**e, "where": self.role} for e in self.engine.events.for_request(message.request_id)]
        self.reply(sender, AuditReply(token=message.token, request_id=message.request_id, events=events))
