"""The prefill worker: computes a prompt's KV in its own pool and sends it, page by page, to decode.

Protocol (disagg/README.md): `prefill` from the router names the decode worker (a configured peer, never
an address this worker has not been given) and the (page, generation) targets it reserved. Admission
fails closed: a prompt this pool can never hold is answered `rejected`, and nothing is computed or sent.
Otherwise the KV of every prompt token but the last is computed, each page is sent with its target, its
slot count and an xxh3 checksum of its bytes, then `complete`. An `abort` from the decode worker the
transfer targets is answered with `abort_ack` on the same channel as the pages, so the ack proves nothing
of that request is still on the way.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import xxhash

from kvfence.disagg.connector import Connector
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.messages import Abort, AbortAck, Accepted, Complete, Page, Prefill, Rejected
from kvfence.disagg.worker import Worker
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.request import Status


@dataclass
class Transfer:
    request_id: str
    decode: str  # the decode worker's address
    targets: list[tuple[int, int]]  # decode-side (page, generation) per logical page
    num_tokens: int  # tokens whose KV decode expects
    placeholder: bool = False  # fault `placeholder_transfer`: one token computed, "complete" claimed


class PrefillWorker(Worker):
    role = "prefill"

    def __init__(self, engine: HandoffEngine, connector: Connector) -> None:
        super().__init__(engine, connector)
        self.transfers: dict[str, Transfer] = {}
        self.faults = engine.faults

    def on_prefill(self, sender: str, message: Prefill) -> None:
        request_id, prompt = message.request_id, message.prompt
        if not self.is_peer(message.decode, "decode"):
            self.drop(sender, "bad_peer", f"prefill {request_id}: {message.decode} is not a decode worker")
            return
        targets = [(page, generation) for page, generation in message.targets]
        transfer = Transfer(request_id, message.decode, targets, len(prompt) - 1)
        try:
            self.engine.add_prefill(prompt[:-1], message.tenant, request_id)
        except AdmissionError as refusal:
            if not self.faults.fire("placeholder_transfer"):
                self.reply(sender, Rejected(request_id=request_id, code=refusal.code, message=str(refusal)))
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
            if output.status is Status.TRANSFERRING:
                self._send_pages(transfer)
                self.engine.finish_transfer(output.request_id)
            elif output.finished:  # aborted here (fence): decode must not wait for pages
                failed = output.finish_reason or "aborted"
                self.reply(transfer.decode, Complete(output.request_id, pages=0, tokens=0, failed=failed))

    def _send_pages(self, transfer: Transfer) -> None:
        request = self.engine.requests[transfer.request_id]
        pool, ps = self.engine.pool, self.engine.pool.page_size
        pages = list(zip(request.record.pages, transfer.targets, strict=False))
        if self.faults.fire("partial_transfer"):
            pages = pages[: len(pages) // 2]
            self.engine.events.emit(transfer.request_id, "fault_injected", fault="partial_transfer")
        lost = len(pages) - 1 if pages and self.faults.fire("transfer_failure_ack_mismatch") else None
        corrupt = 0 if pages and self.faults.fire("corrupt_page") else None
        crash_at = len(pages) // 2 if pages and self.faults.fire("worker_crash_mid_transfer") else None
        self.engine.events.emit(transfer.request_id, "transfer_started", pages=len(pages))
        for logical, (source, (page, generation)) in enumerate(pages):
            if logical == crash_at:  # a real crash: the process dies with pages half sent
                self.engine.events.emit(
                    transfer.request_id, "fault_injected", fault="worker_crash_mid_transfer"
                )
                os.kill(os.getpid(), signal.SIGKILL)
            payload = pool.page_bytes(source)
            checksum = xxhash.xxh3_64_intdigest(payload)
            if logical == corrupt:  # a torn write: the first half of the page arrives as zeros
                payload = bytes(len(payload) // 2) + payload[len(payload) // 2 :]
            if logical == lost:
                continue  # the transport drops it; the sender still believes it went out
            slots = min(ps, transfer.num_tokens - logical * ps)
            self.reply(
                transfer.decode,
                Page(transfer.request_id, logical, page, generation, slots, checksum, payload),
            )
        self.reply(
            transfer.decode,
            Complete(transfer.request_id, pages=len(transfer.targets), tokens=transfer.num_tokens),
        )
        self.engine.events.emit(transfer.request_id, "transfer_complete", pages=len(pages))

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
        self.transfers.pop(request_id, None)
        self.engine.abort(request_id, message.reason)
        self.reply(sender, AbortAck(request_id=request_id))
