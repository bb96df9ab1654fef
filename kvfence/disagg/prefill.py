"""The prefill worker: computes a prompt's KV in its own pool and sends it, page by page, to decode.

Protocol (disagg/README.md): `prefill` from the router names the decode worker (a configured peer, never
an address this worker has not been given) and the (page, generation) targets it reserved. Admission
fails closed: a prompt this pool can never hold is answered `rejected`, and nothing is computed or sent.
Otherwise the KV of every prompt token but the last is computed, each page is sent with its target, its
slot count and an xxh3 checksum of its bytes, then `complete`. An `abort` from the decode worker the
transfer targets is answered with `abort_ack` on the same channel as the pages, so the ack proves nothing
of that request is still on the way.

Only written slots leave: a page carries as many slots as the prompt fills, never the tail a recycled page
keeps from its previous owner.

With `--kv-transport nixl` and decode's NIXL agent announced (a `kv_agent` on the authenticated channel),
each page is sealed (AES-GCM under the request's `seal_key`, sent by decode on the same channel) into this
worker's send area, never read by NIXL from the pool, and the sealed slots go as one one-sided WRITE into
decode's landing slots for the granted targets; `complete` follows only once NIXL reports the WRITE done,
and an `abort` of a request whose WRITE is in flight is acknowledged only once NIXL reports it done or
failed (never earlier, never on a timer). A transfer whose key has not come yet waits for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import OrderedDict
from dataclasses import dataclass

import xxhash

from kvfence.disagg.connector import Connector, LinkEvent
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.landing import LandingError
from kvfence.disagg.messages import (
    KV_UNAVAILABLE,
    Abort,
    AbortAck,
    Accepted,
    Complete,
    KvAgent,
    Page,
    Prefill,
    Rejected,
    SealKey,
)
from kvfence.disagg.nixl_transport import AreaLayout, OneSidedAgent, Write
from kvfence.disagg.seal import KEY_BYTES, TAG_BYTES, seal_into
from kvfence.disagg.worker import Worker
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.request import Status

CANCELLED_KEPT = 4096  # request ids aborted before their `prefill` arrived, remembered to refuse it
KEYS_KEPT = 4096  # seal keys that came before their `prefill` (no order between decode and the router)


@dataclass
class Transfer:
    request_id: str
    decode: str  # the decode worker's address
    targets: list[tuple[int, int]]  # decode-side (page, generation) per logical page
    num_tokens: int  # tokens whose KV decode expects
    placeholder: bool = False  # fault `placeholder_transfer`: one token computed, "complete" claimed


@dataclass
class Plan:
    """What a transfer sends, faults applied: (source page, (target page, generation)) per logical page."""

    pages: list[tuple[int, tuple[int, int]]]
    lost: int | None  # logical page the transport drops (`transfer_failure_ack_mismatch`)
    corrupt: int | None  # logical page torn on the way (`corrupt_page`)
    crash_at: int | None  # logical page at which the process dies (`worker_crash_mid_transfer`)


@dataclass
class Posted:
    """A one-sided WRITE in flight; its source pages stay held until NIXL says done or failed."""

    transfer: Transfer
    write: Write | None  # None: nothing to write
    checksums: list[int]
    slots: list[int]  # the send slots it reads, free again once NIXL is done with them
    pages_written: int
    aborted: bool = False  # decode asked to stop: acknowledge when NIXL is done, send no `complete`


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(
        self, engine: HandoffEngine, connector: Connector, agent: OneSidedAgent | None = None
    ) -> None:
        super().__init__(engine, connector)
        self.transfers: dict[str, Transfer] = {}
        self.faults = engine.faults
        self.agent = agent
        # Send slots, one per page of this pool, handed to one transfer at a time: two requests sharing a
        # prefix page seal it under different keys, so a slot is a transfer's, never a source page's.
        self.free_slots = list(range(agent.layout.slots)) if agent is not None else []
        self.decode_agents: dict[str, tuple[str, AreaLayout]] = {}  # decode address -> NIXL agent, area
        self.keys: OrderedDict[tuple[str, str], bytes] = OrderedDict()  # (request, decode) -> seal key
        self.awaiting_key: dict[str, Transfer] = {}  # computed, waiting for decode's seal key
        self.posted: dict[str, Posted] = {}
        # Requests decode aborted before their `prefill` arrived (no order between router and decode): a
        # late `prefill` for one is refused, or its one-sided WRITE would land in pages since given away.
        self.cancelled: OrderedDict[str, None] = OrderedDict()

    def busy(self) -> bool:
        return super().busy() or bool(self.posted) or bool(self.awaiting_key)

    def kv_transport(self) -> str:
        return "nixl" if self.agent is not None else "zmq"

    def on_prefill(self, sender: str, message: Prefill) -> None:
        request_id, prompt = message.request_id, message.prompt
        if not self.is_peer(message.decode, "decode"):
            self.drop(sender, "bad_peer", f"prefill {request_id}: {message.decode} is not a decode worker")
            return
        if request_id in self.cancelled:
            self.reply(sender, Rejected(request_id, "cancelled", "Cancelled before prefill started."))
            return
        if (why := self.kv_refusal()) is not None:
            refusal = f"This prefill worker sends no KV: {why}. Retry later."
            self.reply(sender, Rejected(request_id, KV_UNAVAILABLE, refusal, 503))
            return
        targets = [(page, generation) for page, generation in message.targets]
        transfer = Transfer(request_id, message.decode, targets, len(prompt) - 1)
        try:
            self.engine.add_prefill(prompt[:-1], message.tenant, request_id)
        except AdmissionError as refusal:
            if not self.faults.fire("placeholder_transfer"):
                self.reply(sender, Rejected.of(request_id, refusal))
                return
            # The incident: the over-long prompt is swapped for a one-token placeholder and the transfer
            # of that single page is then reported complete.
            self.engine.events.emit(request_id, "fault_injected", fault="placeholder_transfer")
            self.engine.add_prefill(prompt[:1], message.tenant, request_id)
            transfer.placeholder = True
        self.transfers[request_id] = transfer
        self.reply(sender, Accepted(request_id=request_id))

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            transfer = self.transfers.pop(output.request_id, None)
            if transfer is None:
                continue
            one_sided = (
                self.agent is not None and self.agent.serving and transfer.decode in self.decode_agents
            )
            if output.status is Status.TRANSFERRING and one_sided:
                self.awaiting_key[transfer.request_id] = transfer
                self._post_when_keyed(transfer.request_id)
            elif output.status is Status.TRANSFERRING:  # decode has no NIXL agent (or not yet): ZeroMQ
                if not self._unreadable(transfer) and self._send_pages(transfer):
                    self.engine.finish_transfer(output.request_id)
            elif output.finished:  # aborted here (fence): decode must not wait for pages
                failed = output.finish_reason or "aborted"
                self.reply(transfer.decode, Complete(output.request_id, pages=0, tokens=0, failed=failed))

    def _plan(self, transfer: Transfer) -> Plan:
        """The pages to send, with the armed transfer faults applied (the same on both transports)."""
        request = self.engine.requests[transfer.request_id]
        pages = list(zip(request.record.pages, transfer.targets, strict=False))
        if self.faults.fire("partial_transfer"):
            pages = pages[: len(pages) // 2]
            self.engine.events.emit(transfer.request_id, "fault_injected", fault="partial_transfer")
        lost = len(pages) - 1 if pages and self.faults.fire("transfer_failure_ack_mismatch") else None
        corrupt = 0 if pages and self.faults.fire("corrupt_page") else None
        crash_at = len(pages) // 2 if pages and self.faults.fire("worker_crash_mid_transfer") else None
        self.engine.events.emit(
            transfer.request_id, "transfer_started", pages=len(pages), transport=self.kv_transport()
        )
        return Plan(pages, lost, corrupt, crash_at)

    def _crash(self, request_id: str) -> None:
        """A real crash: the process dies with the transfer half done."""
        self.engine.events.emit(request_id, "fault_injected", fault="worker_crash_mid_transfer")
        os.kill(os.getpid(), signal.SIGKILL)

    def _unreadable(self, transfer: Transfer) -> bool:
        """Before any page is read to be sent: the request's pages must still be its own, current and
        written as far as it computed (the fence's read check). If not, the request is aborted here and
        decode told the transfer failed: no page leaves."""
        request = self.engine.requests[transfer.request_id]
        reason = self.engine.fence.check_record(request.record, request.num_computed_tokens)
        if reason is None:
            return False
        self.engine.abort(transfer.request_id, reason)
        self.reply(transfer.decode, Complete(transfer.request_id, pages=0, tokens=0, failed=reason))
        return True

    def _send_pages(self, transfer: Transfer) -> bool:
        """Every page as a frame, then `complete`; whether all went out. At the first page the connector
        drops, the request has been failed (`reply`) and no other page is read: decode is told the
        transfer failed (if that too is dropped, decode's transfer deadline ends it)."""
        pool, plan = self.engine.pool, self._plan(transfer)
        for logical, (source, (page, generation)) in enumerate(plan.pages):
            if logical == plan.crash_at:
                self._crash(transfer.request_id)
            payload = pool.page_bytes(source, self.engine.page_slots(transfer.num_tokens, logical))
            checksum = xxhash.xxh3_64_intdigest(payload)
            if logical == plan.corrupt:  # a torn write: the first half of the page arrives as zeros
                payload = bytes(len(payload) // 2) + payload[len(payload) // 2 :]
            if logical == plan.lost:
                continue  # the transport drops it; the sender still believes it went out
            page_frame = Page(transfer.request_id, logical, page, generation, checksum, payload)
            if not self.reply(transfer.decode, page_frame):
                self.reply(transfer.decode, Complete(transfer.request_id, 0, 0, failed="send_blocked"))
                return False
        complete = Complete(transfer.request_id, pages=len(transfer.targets), tokens=transfer.num_tokens)
        if not self.reply(transfer.decode, complete):
            return False
        self.engine.events.emit(transfer.request_id, "transfer_complete", pages=len(plan.pages))
        return True

    # ---- one-sided writes (NIXL) ------------------------------------------------------------------------

    def on_link(self, event: LinkEvent) -> None:
        """A decode worker's link went down: a restarted one has a new NIXL agent, which it announces
        before its first grant; until then its pages go as ZeroMQ frames, never to the old agent."""
        if not event.up:
            self._forget_agent(event.peer)

    def _forget_agent(self, decode: str) -> None:
        """Its pages go as ZeroMQ frames until it announces an agent again."""
        if (known := self.decode_agents.pop(decode, None)) is not None and self.agent is not None:
            with contextlib.suppress(LandingError):
                self.agent.remove_peer(known[0])

    def on_kv_agent(self, sender: str, message: KvAgent) -> None:
        """A decode worker says where its landing area lies (authenticated: only a decode key can send it),
        or, with no metadata, that it has none right now."""
        if not message.payload:
            self._forget_agent(sender)
            return
        layout = AreaLayout(message.base, message.slots, message.slot_bytes)
        if self.agent is None or not self.agent.layout.compatible(layout):
            why = "no NIXL agent here" if self.agent is None else "its landing slots differ from ours"
            self.drop(sender, "bad_kv_agent", why)
            return
        self._forget_agent(sender)  # a restarted landing process: a new agent
        try:
            self.decode_agents[sender] = (self.agent.add_peer(message.payload), layout)
        except LandingError as exc:  # its pages go as ZeroMQ frames until it announces again
            self.drop(sender, "bad_kv_agent", str(exc))

    def on_seal_key(self, sender: str, message: SealKey) -> None:
        """The key decode will open this request's pages with; kept per (request, decode), so only the
        decode worker a transfer targets can key it."""
        try:
            key = bytes.fromhex(message.key)
        except ValueError:
            key = b""
        if len(key) != KEY_BYTES:
            self.drop(sender, "bad_field", f"seal_key of {message.request_id}: not a {KEY_BYTES}-byte key")
            return
        self.keys[(message.request_id, sender)] = key
        while len(self.keys) > KEYS_KEPT:
            self.keys.popitem(last=False)
        self._post_when_keyed(message.request_id)

    def _post_when_keyed(self, request_id: str) -> None:
        """Post a computed transfer once its key is here and send slots are free for its pages."""
        transfer, request = self.awaiting_key.get(request_id), self.engine.requests.get(request_id)
        if transfer is not None and request is None:  # ended here meanwhile: nothing left to send
            del self.awaiting_key[request_id]
        if transfer is None or request is None or (request_id, transfer.decode) not in self.keys:
            return
        if len(self.free_slots) < len(request.record):
            return  # `tick` tries again as WRITEs finish
        del self.awaiting_key[request_id]
        key = self.keys.pop((request_id, transfer.decode))
        if not self._unreadable(transfer):
            self._post(transfer, key)

    def _post(self, transfer: Transfer, key: bytes) -> None:
        """Seal each page's written slots into its send slot, then WRITE those slots into the granted
        landing slots; `tick` finishes it. NIXL reads only the send area, never the pool."""
        assert self.agent is not None
        pool, plan, area = self.engine.pool, self._plan(transfer), self.agent.area
        slots = [self.free_slots.pop() for _ in plan.pages]
        checksums = []
        for logical, (source, (page, generation)) in enumerate(plan.pages):
            plain = pool.page_bytes(source, self.engine.page_slots(transfer.num_tokens, logical))
            slot, sealed = slots[logical], len(plain) + TAG_BYTES
            seal_into(key, transfer.request_id, logical, page, generation, plain, area[slot, :sealed].data)
            area[slot, sealed:] = 0
            checksums.append(xxhash.xxh3_64_intdigest(area[slot, :sealed]))
            if logical == plan.corrupt:  # a torn write: the first half of the sealed page arrives as zeros
                area[slot, : sealed // 2] = 0
        pairs = [(slots[i], page) for i, (_, (page, _)) in enumerate(plan.pages) if i != plan.lost]
        if plan.crash_at is not None:
            pairs = pairs[: plan.crash_at]
        peer, layout = self.decode_agents[transfer.decode]
        write = self.agent.write(peer, layout, pairs, transfer.request_id) if pairs else None
        self.posted[transfer.request_id] = Posted(transfer, write, checksums, slots, len(pairs))
        if plan.crash_at is not None:
            self._crash(transfer.request_id)

    def tick(self, now: float) -> None:
        for request_id in list(self.awaiting_key):
            self._post_when_keyed(request_id)
        for request_id, posted in list(self.posted.items()):
            state = "DONE" if posted.write is None or self.agent is None else self.agent.poll(posted.write)
            if state == "PROC":
                continue
            del self.posted[request_id]
            self.free_slots += posted.slots
            transfer = posted.transfer
            if posted.aborted:  # NIXL is done with it: now nothing more can land
                self.engine.abort(request_id, "aborted_by_decode")
                self.reply(transfer.decode, AbortAck(request_id=request_id))
                continue
            failed = "" if state == "DONE" else "transfer_failed"
            # `pages`: how many the WRITE carried (0: none, so decode waits for no notification)
            tokens, pages = (transfer.num_tokens, posted.pages_written) if not failed else (0, 0)
            checksums = posted.checksums if not failed else None
            agent = self.agent.agent_name if self.agent is not None else ""
            self.reply(transfer.decode, Complete(request_id, pages, tokens, failed, checksums, agent))
            self.engine.events.emit(request_id, "transfer_complete", pages=len(posted.checksums), nixl=state)
            self.engine.finish_transfer(request_id)

    def on_abort(self, sender: str, message: Abort) -> None:
        """Decode gave up on a request: stop, free the source pages, and acknowledge on the data channel
        (after every page already sent, so the ack proves nothing more is on the way). Only the decode
        worker the transfer targets may stop it."""
        request_id = message.request_id
        transfer = self.transfers.get(request_id)
        if transfer is not None and transfer.decode != sender:
            self.drop(sender, "not_assigned", f"abort of {request_id}, which targets {transfer.decode}")
            return
        if self.faults.fire("late_write_after_cancel"):
            # The bug: the ack goes out but the work does not stop; the request's pages follow the ack.
            self.engine.events.emit(request_id, "fault_injected", fault="late_write_after_cancel")
            self.reply(sender, AbortAck(request_id=request_id))
            return
        posted = self.posted.get(request_id)
        if posted is not None:  # a WRITE is in flight: acknowledged only when NIXL says done or failed
            posted.aborted = True
            return
        self.awaiting_key.pop(request_id, None)
        if self.transfers.pop(request_id, None) is None:
            self.cancelled[request_id] = None
            while len(self.cancelled) > CANCELLED_KEPT:
                self.cancelled.popitem(last=False)
        self.engine.abort(request_id, message.reason)
        self.reply(sender, AbortAck(request_id=request_id))
