"""The decode worker: reserves pages for a prompt's KV, receives them through fenced writes, decodes.

With isolation on (the default):
- every incoming page must target an entry of the request's record at its current generation, match its
  checksum and land in an OWNED page of the request's tenant; anything else is refused and counted, and a
  corrupt or misdirected page aborts its request;
- `complete` is never trusted: decode starts only when `written` covers every prompt token on every page;
- a request aborted while its transfer may be in flight keeps its pages QUARANTINED until the prefill
  worker's abort-ack (or the loss of its connection) proves nothing more can land in them; a reservation
  the assigned prefill never wrote into (no page, no `complete` from it) is released when it times out,
  so a reservation alone can never pin the pool;
- only the router that reserved a request may abort it, and only the prefill worker it assigned may
  write, complete or acknowledge it; a tenant may hold at most `max_reserved_pages` pages waiting for KV.
One-sided writes (`--kv-transport nixl`): decode announces its registered pool to a prefill worker over
the authenticated channel (`kv_agent`) and grants targets per request as before; the prefill WRITEs them
and then sends `complete` with each page's xxh3. Nothing is marked written until, for every granted page,
the generation is still the granted one, the bytes now in the pool match the checksum and the pages cover
the prompt. A request aborted while a WRITE may be in flight stays QUARANTINED until the prefill's ack
(sent only once NIXL says done or failed) and, if it wrote, the WRITE's own notification here; or until
the prefill is gone. A notification for a grant already given up is a late write: the requests now
holding those pages are aborted, checked between steps and after each forward before its tokens are taken.
With isolation off every one of those checks is skipped — only the lab and the fault tests do that.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvfence.disagg.connector import Connector, LinkEvent
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.messages import (
    Abort,
    AbortAck,
    Complete,
    KvAgent,
    Output,
    Page,
    Rejected,
    Reserve,
    Reserved,
)
from kvfence.disagg.nixl_transport import NixlAgent
from kvfence.disagg.worker import Worker
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.request import Status
from kvfence.trail.reasons import CHECKSUM_MISMATCH, INCOMPLETE_HANDOFF, STALE_WRITE
from kvfence.units import cdiv

TRANSFER_TIMEOUT_S = 30.0  # a transfer with no progress this long is aborted
SERVER_BUSY = "server_busy"
RELEASED_GRANTS_KEPT = 4096  # one-sided grants given up, remembered to recognise a late WRITE's notification
NIXL_POLL_S = 0.001  # the longest wait on the socket while a one-sided grant is live (see `wait_s`)


@dataclass
class Inbound:
    router: str
    prefill: str
    last_progress: float
    started: bool = False  # the assigned prefill sent a page or `complete`: the transfer has begun
    notified: bool = False  # a NIXL WRITE's notification for it arrived (its bytes have landed)
    acked_write: bool = False  # prefill acked an abort after a WRITE: drained when that WRITE notifies
    grant: list[tuple[int, int]] = field(default_factory=list)  # the (page, generation) targets granted
    wrote: bool = False  # prefill reported a finished WRITE into the grant (its notification is due)


class DecodeWorker(Worker):
    role = "decode"

    def __init__(
        self,
        engine: HandoffEngine,
        connector: Connector,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        max_reserved_pages: int | None = None,
        agent: NixlAgent | None = None,
    ) -> None:
        super().__init__(engine, connector)
        self.agent = agent  # this pool registered with NIXL: prefill workers may WRITE into granted pages
        engine.late_write_victims = self.late_write_victims
        self.announced: set[str] = set()  # prefill workers that were sent our NIXL agent
        # One-sided grants given up: any notification for one is a late write; `expected` ones still await
        # the notification of a WRITE that NIXL reported done before they were given up.
        self.released: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()
        self.expected: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()
        self.inbound: dict[
            str, Inbound
        ] = {}  # requests whose KV is on the way, or whose abort awaits a drain
        self.routers: dict[str, str] = {}  # request id -> router to stream outputs to
        self.transfer_timeout_s = transfer_timeout_s
        # Pages one tenant may hold while waiting for KV. By default half the pool (so one tenant's
        # reservations cannot take all of it), but never less than one request at the window holds.
        self.max_reserved_pages = max_reserved_pages or max(
            self._pages_for(engine.max_model_len), engine.pool.num_pages // 2
        )
        self.down_peers: set[str] = set()  # prefill workers whose connection is lost
        pool = engine.pool
        self._page_bytes = pool.kv[:, :, 0].numel() * pool.kv.element_size()

    @property
    def isolation(self) -> bool:
        return self.engine.fence.enabled

    def wait_s(self) -> float:
        """NIXL runs without its progress thread (that thread spins a core even when idle), so over TCP a
        WRITE's bytes and every notification land only while this worker polls its agent (`tick`): while
        a grant is live, poll at least every NIXL_POLL_S instead of sleeping on the socket."""
        if self.agent is not None and self.inbound:
            return min(super().wait_s(), NIXL_POLL_S)
        return super().wait_s()

    # ---- from the router --------------------------------------------------------------------------------

    def on_reserve(self, sender: str, message: Reserve) -> None:
        request_id, prompt = message.request_id, message.prompt
        if not self.is_peer(message.prefill, "prefill"):
            self.drop(sender, "bad_peer", f"reserve {request_id}: {message.prefill} is not a prefill worker")
            return
        if message.prefill in self.down_peers:
            self._reject(sender, request_id, "prefill_unavailable", "The prefill worker is unreachable.")
            return
        if self._reserved_pages(message.tenant) + self._pages_for(len(prompt) - 1) > self.max_reserved_pages:
            self._reject(sender, request_id, SERVER_BUSY, "This tenant holds too many decode pages waiting.")
            return
        try:
            request = self.engine.reserve(prompt, message.sampling(), message.tenant, request_id)
        except AdmissionError as refusal:
            self.reply(sender, Rejected(request_id=request_id, code=refusal.code, message=str(refusal)))
            return
        if request is None:
            self._reject(
                sender, request_id, SERVER_BUSY, "The decode pool has no free pages for this prompt."
            )
            return
        self.routers[request_id] = sender
        targets = [[p, g] for p, g in zip(request.record.pages, request.record.generations, strict=True)]
        if len(prompt) == 1:  # no KV to transfer: the decode side computes the only token itself
            self.engine.resume(request_id)
        else:
            self.connector.connect(
                message.prefill
            )  # watched now, so its loss is noticed even before an abort
            self._announce(message.prefill)
            # With our agent announced, a WRITE may land at any time: the grant is live from now on.
            live = self.agent is not None
            grant = [(p, g) for p, g in targets]
            self.inbound[request_id] = Inbound(sender, message.prefill, time.monotonic(), live, grant=grant)
        self.reply(sender, Reserved(request_id=request_id, targets=targets))

    def _reject(self, router: str, request_id: str, code: str, why: str) -> None:
        self.reply(
            router, Rejected(request_id=request_id, code=code, message=f"{why} Retry later.", status=503)
        )

    def _reserved_pages(self, tenant: str) -> int:
        requests = (self.engine.requests.get(rid) for rid in self.inbound)
        return sum(len(r.record.pages) for r in requests if r is not None and r.tenant == tenant)

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.engine.pool.page_size)

    def on_abort(self, sender: str, message: Abort) -> None:
        """The router gave up (client gone, timeout) or prefill refused the request. Only the router that
        reserved the request may end it."""
        if self.routers.get(message.request_id, sender) != sender:
            self.drop(sender, "not_assigned", f"abort of {message.request_id} from another router")
            return
        self._abort(message.request_id, message.reason)

    # ---- from the prefill worker ------------------------------------------------------------------------

    def on_page(self, sender: str, message: Page) -> None:
        request_id, page, generation = message.request_id, message.page, message.generation
        request = self.engine.requests.get(request_id)
        if not self.isolation:
            self._write(page, message.slots, message.payload)  # blindly, wherever the sender aimed
            self.engine.events.emit(
                request_id,
                "page_received",
                page=page,
                generation=generation,
                slots=message.slots,
                checked=False,
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
        self.inbound[request_id].started = True
        if not 1 <= message.slots <= self.engine.pool.page_size:
            self._refuse(request_id, page, "slot count out of range")
            self._abort(request_id, STALE_WRITE)
            return
        record, logical = request.record, message.logical
        if not logical < len(record.pages) or (record.pages[logical], record.generations[logical]) != (
            page,
            generation,
        ):
            self._refuse(request_id, page, "target is not in the request's record")
            self._abort(request_id, STALE_WRITE)
            return
        if (
            len(message.payload) != self._page_bytes
            or xxhash.xxh3_64_intdigest(message.payload) != message.checksum
        ):
            self._refuse(request_id, page, "checksum mismatch")
            self._abort(request_id, CHECKSUM_MISMATCH)
            return
        one = np.array([page])
        tenant = np.array([record.tenant])
        if not self.engine.pool.authorize_writes(one, np.array([generation]), tenant, np.zeros(1, int))[0]:
            self.engine.events.emit(request_id, "write_refused", page=page, why="stale generation or owner")
            self._abort(request_id, STALE_WRITE)
            return
        self._write(page, message.slots, message.payload)
        self.inbound[request_id].last_progress = time.monotonic()
        self.engine.events.emit(
            request_id, "page_received", page=page, generation=generation, slots=message.slots
        )

    def on_complete(self, sender: str, message: Complete) -> None:
        request_id = message.request_id
        request = self.engine.requests.get(request_id)
        if (
            request is None
            or request.status is not Status.TRANSFERRING
            or not self._from_prefill(sender, request_id)
        ):
            return
        self.inbound[request_id].started = True
        self.inbound[request_id].wrote = message.checksums is not None and not message.failed
        if message.failed:
            self._abort(request_id, message.failed)
            return
        tokens = request.num_tokens - 1
        if self.isolation and message.checksums is not None:
            reason = self._verify_one_sided(request_id, message.checksums)
            if reason is not None:
                self._abort(request_id, reason)
                return
        if self.isolation:
            reason = self.engine.fence.check_handoff(request.record, tokens)
            if reason is not None:
                self._abort(request_id, reason)
                return
        self.inbound.pop(request_id, None)
        self.engine.events.emit(request_id, "transfer_complete", tokens=tokens)
        self.engine.resume(request_id)

    def on_abort_ack(self, sender: str, message: AbortAck) -> None:
        request_id = message.request_id
        if not self._from_prefill(sender, request_id):
            return  # only the worker that was sending may say that nothing more is on the way
        inbound = self.inbound[request_id]
        inbound.wrote = inbound.wrote or message.wrote
        if message.wrote and self.isolation and not inbound.notified:
            inbound.acked_write = True  # its WRITE's notification, when it lands, drains it
            return
        self._drain(request_id, "abort_ack")

    def on_link(self, event: LinkEvent) -> None:
        """This worker's own connection to a prefill worker: when it is gone, nothing more can arrive from
        it, so its quarantined pages can be released (a restarted worker's writes name old generations and
        are refused); while it is gone, reservations naming it are refused."""
        if event.up:
            self.down_peers.discard(event.peer)
            return
        self.down_peers.add(event.peer)
        self.announced.discard(event.peer)  # a restarted worker has a new agent that does not know ours
        for request_id, inbound in list(self.inbound.items()):
            if inbound.prefill == event.peer:
                self._abort(request_id, "prefill_lost")
                self._drain(request_id, "peer_down")

    # ---- decode output and deadlines --------------------------------------------------------------------

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send_output(output)

    def tick(self, now: float) -> None:
        for victim in self.late_write_victims():
            self._abort(victim, STALE_WRITE)
        for request_id, inbound in list(self.inbound.items()):
            request = self.engine.requests.get(request_id)
            if request is not None and now - inbound.last_progress > self.transfer_timeout_s:
                # Nothing ever came from the assigned prefill: its pages were never written into, and a
                # reservation alone must not pin the pool (a prefill that never connects never acks).
                self._abort(request_id, "transfer_timeout", release=not inbound.started)

    # ---- one-sided writes (NIXL) ------------------------------------------------------------------------

    def _announce(self, prefill: str) -> None:
        """Send a prefill worker our NIXL agent and pool layout, once per connection, on the authenticated
        channel, before the first grant it will write into (the router sends `prefill` after `reserved`)."""
        if self.agent is None or prefill in self.announced:
            return
        pool = self.agent.layout
        metadata = self.agent.metadata()
        self.reply(prefill, KvAgent(pool.base, pool.layers, pool.pages, pool.block_bytes, metadata))
        self.announced.add(prefill)

    def _verify_one_sided(self, request_id: str, checksums: list[int]) -> str | None:
        """Every granted page covering the prompt: still at its granted generation, owned by the tenant and
        OWNED, its bytes now in the pool matching prefill's checksum. Only then are its slots written."""
        request, pool = self.engine.requests[request_id], self.engine.pool
        tokens, ps, record = request.num_tokens - 1, pool.page_size, request.record
        needed = cdiv(tokens, ps)
        if len(checksums) != needed or len(record.pages) < needed:
            return INCOMPLETE_HANDOFF
        pages = np.array(record.pages[:needed])
        tenants = np.full(needed, record.tenant)
        generations, first_slots = np.array(record.generations[:needed]), np.zeros(needed, dtype=np.int64)
        if not pool.authorize_writes(pages, generations, tenants, first_slots).all():
            self.engine.events.emit(request_id, "write_refused", why="stale generation or owner")
            return STALE_WRITE
        for logical, (page, checksum) in enumerate(zip(pages.tolist(), checksums, strict=True)):
            if pool.page_checksum(page) != checksum:
                self._refuse(request_id, page, "checksum mismatch (one-sided write)")
                return CHECKSUM_MISMATCH
            slots = min(ps, tokens - logical * ps)
            pool.commit_writes(np.full(slots, page), np.arange(slots))
            self.engine.events.emit(
                request_id, "page_received", page=page, generation=record.generations[logical], slots=slots
            )
        return None

    def late_write_victims(self) -> list[str]:
        """Poll NIXL's notifications (between steps, and from the engine after each forward, before its
        tokens are taken): the live requests a late WRITE hit, for the caller to abort. A victim still
        waiting for its own transfer is aborted here, through the quarantine its grant needs."""
        victims: list[str] = []
        for request_id in self.agent.notified() if self.agent is not None else []:
            victims += self._on_notified(request_id)
        waiting = [v for v in victims if self.engine.requests[v].status is Status.TRANSFERRING]
        for victim in waiting:
            self._abort(victim, STALE_WRITE)
        return [v for v in dict.fromkeys(victims) if v not in waiting]

    def _on_notified(self, request_id: str) -> list[str]:
        """A WRITE's bytes landed. For a live grant that is progress (and, after an ack, the drain); for a
        grant already given up it is a late write: whoever holds those pages now may read its bytes.
        Returns those holders."""
        inbound = self.inbound.get(request_id)
        if inbound is not None:
            inbound.notified = True
            if inbound.acked_write:
                self._drain(request_id, "nixl_notified")
            return []
        if request_id in self.expected:  # the due notification of a WRITE NIXL reported done: no alarm
            self._remember(self.released, request_id, self.expected.pop(request_id))
            return []
        grant = self.released.pop(request_id, None)
        if grant is None or not self.isolation:
            return []
        pool, victims = self.engine.pool, []
        for page, generation in grant:
            self._refuse(request_id, page, "one-sided write after its grant was released (late write)")
            for victim in self.engine.requests.values():
                if page in victim.record.pages and pool.generation[page] != generation:
                    victims.append(victim.request_id)
        return victims

    def _drain(self, request_id: str, how: str) -> None:
        """Release a quarantined request (and forget its transfer), remembering a one-sided grant so that a
        late WRITE into it is recognised."""
        inbound = self.inbound.pop(request_id, None)
        if self.agent is not None and inbound is not None:
            due = inbound.wrote and not inbound.notified
            self._remember(self.expected if due else self.released, request_id, inbound.grant)
        self.engine.drain(request_id, how)

    @staticmethod
    def _remember(table: OrderedDict[str, list[tuple[int, int]]], request_id: str, grant: list) -> None:
        table[request_id] = grant
        while len(table) > RELEASED_GRANTS_KEPT:
            table.popitem(last=False)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()

    # ---- helpers ----------------------------------------------------------------------------------------

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

    def _abort(self, request_id: str, reason: str, release: bool = False) -> None:
        """Abort a request. Mid-transfer (isolation on) its pages stay quarantined until prefill acks;
        `release`: the transfer never started, so they are released at once (a late page would find no
        transfer to write into and be refused)."""
        request = self.engine.requests.get(request_id)
        if request is None:
            return
        inbound = self.inbound.get(request_id) if request.status is Status.TRANSFERRING else None
        hold = inbound is not None and self.isolation and not release
        output = self.engine.abort(request_id, reason, quarantine=hold)
        if inbound is not None:
            self.reply(inbound.prefill, Abort(request_id=request_id, reason=reason))
            if not hold:
                self.inbound.pop(request_id, None)
            elif inbound.prefill in self.down_peers:  # nobody is left to send anything: fenced by its death
                self._drain(request_id, "peer_down")
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
            Output(
                request_id=output.request_id,
                token_ids=output.new_token_ids,
                text=output.new_text,
                finished=output.finished,
                status=output.status.value,
                finish_reason=output.finish_reason,
                prompt_tokens=output.prompt_tokens,
                completion_tokens=output.completion_tokens,
            ),
        )
