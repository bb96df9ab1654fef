"""The decode worker: reserves pages for a prompt's KV, receives them through fenced writes, decodes.

With isolation on (the default):
- every incoming page must target an entry of the request's record at its current generation, match its
  checksum and land in an OWNED page of the request's tenant; anything else is refused and counted, and a
  corrupt or misdirected page aborts its request;
- `complete` is never trusted: decode starts only when `written` covers every prompt token on every page;
- a request aborted while its transfer may be in flight keeps its pages QUARANTINED until the prefill
  worker's abort-ack (or the loss of its connection) proves nothing more can land in them.
With isolation off every one of those checks is skipped — only the lab and the fault tests do that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import xxhash

from kvfence.disagg.connector import Connector, Message
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.worker import Worker
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import CHECKSUM_MISMATCH, STALE_WRITE

TRANSFER_TIMEOUT_S = 30.0  # a transfer with no progress this long is aborted (its pages stay quarantined)


@dataclass
class Inbound:
    router: str
    prefill: str
    last_progress: float


class DecodeWorker(Worker):
    role = "decode"

    def __init__(
        self, engine: HandoffEngine, connector: Connector, transfer_timeout_s: float = TRANSFER_TIMEOUT_S
    ) -> None:
        super().__init__(engine, connector)
        self.inbound: dict[
            str, Inbound
        ] = {}  # requests whose KV is on the way, or whose abort awaits a drain
        self.routers: dict[str, str] = {}  # request id -> router to stream outputs to
        self.transfer_timeout_s = transfer_timeout_s
        self.down_peers: set[str] = set()  # prefill workers whose connection is lost
        pool = engine.pool
        self._page_bytes = pool.kv[:, :, 0].numel() * pool.kv.element_size()

    @property
    def isolation(self) -> bool:
        return self.engine.fence.enabled

    # ---- from the router --------------------------------------------------------------------------------

    def on_reserve(self, sender: str, message: Message) -> None:
        f = message.fields
        request_id, prompt = f["request_id"], f["prompt"]
        if f["prefill"] in self.down_peers:
            self.reply(
                sender,
                "rejected",
                request_id=request_id,
                code="prefill_unavailable",
                status=503,
                message="The prefill worker is unreachable; retry later.",
            )
            return
        try:
            request = self.engine.reserve(prompt, SamplingParams(**f["params"]), f["tenant"], request_id)
        except AdmissionError as refusal:
            self.reply(sender, "rejected", request_id=request_id, code=refusal.code, message=str(refusal))
            return
        if request is None:
            self.reply(
                sender,
                "rejected",
                request_id=request_id,
                code="server_busy",
                status=503,
                message="The decode pool has no free pages for this prompt right now; retry later.",
            )
            return
        self.routers[request_id] = sender
        targets = list(zip(request.record.pages, request.record.generations, strict=True))
        if len(prompt) == 1:  # no KV to transfer: the decode side computes the only token itself
            self.engine.resume(request_id)
        else:
            self.connector_connect(f["prefill"])
            self.inbound[request_id] = Inbound(sender, f["prefill"], time.monotonic())
        self.reply(sender, "reserved", request_id=request_id, targets=targets)

    def on_abort(self, sender: str, message: Message) -> None:
        """The router gave up (client gone, timeout) or prefill refused the request."""
        self._abort(message.fields["request_id"], message.fields.get("reason", "cancelled"))

    # ---- from the prefill worker ------------------------------------------------------------------------

    def on_page(self, sender: str, message: Message) -> None:
        f = message.fields
        request_id, page, generation = f["request_id"], f["page"], f["generation"]
        request = self.engine.requests.get(request_id)
        if not self.isolation:
            self._write(page, f["slots"], message.payload)  # blindly, wherever the sender aimed
            self.engine.events.emit(
                request_id, "page_received", page=page, generation=generation, slots=f["slots"], checked=False
            )
            return
        if (
            request is None
            or request.status is not Status.TRANSFERRING
            or not self._from_prefill(sender, request_id)
        ):
            self._refuse(
                request_id, page, "no transfer in progress from this sender (late write after cancel)"
            )
            return
        if not 1 <= f["slots"] <= self.engine.pool.page_size:
            self._refuse(request_id, page, "slot count out of range")
            self._abort(request_id, STALE_WRITE)
            return
        record, logical = request.record, f["logical"]
        if not 0 <= logical < len(record.pages) or (record.pages[logical], record.generations[logical]) != (
            page,
            generation,
        ):
            self._refuse(request_id, page, "target is not in the request's record")
            self._abort(request_id, STALE_WRITE)
            return
        if (
            len(message.payload) != self._page_bytes
            or xxhash.xxh3_64_intdigest(message.payload) != f["checksum"]
        ):
            self._refuse(request_id, page, "checksum mismatch")
            self._abort(request_id, CHECKSUM_MISMATCH)
            return
        one = np.array([page])
        if not self.engine.pool.authorize_writes(one, np.array([generation]), np.array([record.tenant]))[0]:
            self.engine.events.emit(request_id, "write_refused", page=page, why="stale generation or owner")
            self._abort(request_id, STALE_WRITE)
            return
        self._write(page, f["slots"], message.payload)
        self.inbound[request_id].last_progress = time.monotonic()
        self.engine.events.emit(
            request_id, "page_received", page=page, generation=generation, slots=f["slots"]
        )

    def on_complete(self, sender: str, message: Message) -> None:
        f = message.fields
        request_id = f["request_id"]
        request = self.engine.requests.get(request_id)
        if (
            request is None
            or request.status is not Status.TRANSFERRING
            or not self._from_prefill(sender, request_id)
        ):
            return
        if f.get("failed"):
            self._abort(request_id, f["failed"])
            return
        tokens = request.num_tokens - 1
        if self.isolation:
            reason = self.engine.fence.check_handoff(request.record, tokens)
            if reason is not None:
                self._abort(request_id, reason)
                return
        self.inbound.pop(request_id, None)
        self.engine.events.emit(request_id, "transfer_complete", tokens=tokens)
        self.engine.resume(request_id)

    def on_abort_ack(self, sender: str, message: Message) -> None:
        request_id = message.fields["request_id"]
        if not self._from_prefill(sender, request_id):
            return  # only the worker that was sending may say that nothing more is on the way
        self.inbound.pop(request_id, None)
        self.engine.drain(request_id, "abort_ack")

    def on_peer_down(self, sender: str, message: Message) -> None:
        """The prefill worker's connection is gone: nothing more can arrive from it, so its quarantined
        pages can be released (a restarted worker's writes name old generations and are refused)."""
        peer = message.fields["peer"]
        self.down_peers.add(peer)
        for request_id, inbound in list(self.inbound.items()):
            if inbound.prefill == peer:
                self._abort(request_id, "prefill_lost")
                self.inbound.pop(request_id, None)
                self.engine.drain(request_id, "peer_down")

    def on_peer_up(self, sender: str, message: Message) -> None:
        self.down_peers.discard(message.fields["peer"])

    # ---- decode output and deadlines --------------------------------------------------------------------

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send_output(output)

    def tick(self, now: float) -> None:
        for request_id, inbound in list(self.inbound.items()):
            request = self.engine.requests.get(request_id)
            if request is not None and now - inbound.last_progress > self.transfer_timeout_s:
                self._abort(request_id, "transfer_timeout")

    # ---- helpers ----------------------------------------------------------------------------------------

    def connector_connect(self, peer: str) -> None:
        connect = getattr(self.connector, "connect", None)
        if connect is not None:
            connect(peer)  # watch the connection now, so its loss is noticed even before any abort

    def _write(self, page: int, slots: int, payload: bytes) -> None:
        self.engine.pool.load_page_bytes(page, payload)
        self.engine.pool.commit_writes(np.full(slots, page), np.arange(slots))

    def fail_request(self, request_id: str, reason: str) -> None:
        self._abort(request_id, reason)

    def _from_prefill(self, sender: str, request_id: str) -> bool:
        inbound = self.inbound.get(request_id)
        return inbound is not None and inbound.prefill == sender

    def _refuse(self, request_id: str, page: int, why: str) -> None:
        self.engine.pool.refused_writes += 1
        self.engine.events.emit(request_id, "write_refused", page=page, why=why)

    def _abort(self, request_id: str, reason: str) -> None:
        """Abort a request; mid-transfer (isolation on) its pages stay quarantined until prefill acks."""
        request = self.engine.requests.get(request_id)
        if request is None:
            return
        in_flight = request.status is Status.TRANSFERRING and request_id in self.inbound
        output = self.engine.abort(request_id, reason, quarantine=in_flight and self.isolation)
        if in_flight:
            prefill = self.inbound[request_id].prefill
            self.reply(prefill, "abort", request_id=request_id, reason=reason)
            if not self.isolation:
                self.inbound.pop(request_id, None)
            elif prefill in self.down_peers:  # nobody is left to send anything: fenced by its death
                self.inbound.pop(request_id, None)
                self.engine.drain(request_id, "peer_down")
        if output is not None:
            self._send_output(output)

    def _send_output(self, output: RequestOutput) -> None:
        router = self.routers.get(output.request_id)
        if router is None:
            return
        if output.finished:
            del self.routers[output.request_id]
        self.reply(
            router,
            "output",
            request_id=output.request_id,
            token_ids=output.new_token_ids,
            text=output.new_text,
            finished=output.finished,
            status=output.status.value,
            finish_reason=output.finish_reason,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
        )
