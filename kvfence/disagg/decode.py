"""The decode worker: reserves pages for a prompt's KV, receives them through fenced writes, decodes.

With isolation on (the default):
- every incoming page must target an entry of the request's record at its current generation, match its
  checksum and land in an OWNED page of the request's tenant; anything else is refused and counted, and a
  corrupt or misdirected page aborts its request;
- `complete` is never trusted: decode starts only when `written` covers every prompt token on every page;
- a request aborted while its transfer may be in flight keeps its pages QUARANTINED until the prefill
  worker's abort-ack (or the loss of its connection) proves nothing more can land in them, or until
  QUARANTINE_S passes: then they are drained and that prefill is refused for PEER_FENCE_S; a reservation
  the assigned prefill never wrote into (no page, no `complete` from it) is released when it times out,
  so a reservation alone can never pin the pool;
- only the router that reserved a request may abort it, and only the prefill worker it assigned may
  write, complete or acknowledge it; a tenant may hold at most `max_reserved_pages` pages waiting for KV.
One-sided writes (`--kv-transport nixl`): decode announces its landing area (one slot per pool page,
registered with NIXL; the pool never is) to a prefill worker over the authenticated channel (`kv_agent`),
and gives it, per request, the key the pages are sealed with (`seal_key`, AES-GCM, never on the fabric).
The prefill WRITEs sealed pages into the landing slots of the granted targets and then sends `complete`.
Nothing enters the pool until, for every page covering the prompt, the sealed bytes in its landing slot
open under the request's key for exactly that (request, logical page, page, generation), the page is still
at its granted generation, owned by the tenant, exclusive and unwritten; then its plaintext (the written
slots only) is copied in as a fenced write and the landing slot is cleared. A write that lands later, or
from anyone else, reaches only a landing slot: it can make a transfer fail, never a page that is read.
With isolation off every one of those checks is skipped — only the lab and the fault tests do that.
"""

from __future__ import annotations

import time
from collections import Counter

import numpy as np
import xxhash

from kvfence.disagg.connector import Connector, LinkEvent
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.inbound import Inbound, Phase
from kvfence.disagg.landing import LandingError
from kvfence.disagg.landing_slots import LandingSlots
from kvfence.disagg.landing_wire import Notification
from kvfence.disagg.messages import (
    KV_UNAVAILABLE,
    Abort,
    AbortAck,
    Complete,
    KvAgent,
    Page,
    Rejected,
    Reserve,
    Reserved,
    SealKey,
)
from kvfence.disagg.nixl_transport import OneSidedAgent
from kvfence.disagg.outputs import to_wire
from kvfence.disagg.seal import new_key
from kvfence.disagg.worker import Worker, log
from kvfence.engine.engine import AdmissionError
from kvfence.engine.output import RequestOutput
from kvfence.grammar.compiler import GrammarCompiler, GrammarError, RequestGrammar
from kvfence.request import Status, fork_id
from kvfence.trail.reasons import CHECKSUM_MISMATCH, INCOMPLETE_HANDOFF, STALE_WRITE
from kvfence.units import cdiv

TRANSFER_TIMEOUT_S = 30.0  # a transfer with no progress this long is aborted
QUARANTINE_S = 10.0  # an aborted transfer whose prefill has not acknowledged by then is fenced off
PEER_FENCE_S = 60.0  # how long a prefill whose quarantine expired is refused
SERVER_BUSY = "server_busy"
NIXL_POLL_S = 0.001  # the longest wait on the socket while a one-sided grant is live (see `wait_s`)


class DecodeWorker(Worker):
    role = "decode"

    def __init__(
        self,
        engine: HandoffEngine,
        connector: Connector,
        transfer_timeout_s: float = TRANSFER_TIMEOUT_S,
        max_reserved_pages: int | None = None,
        agent: OneSidedAgent | None = None,
    ) -> None:
        super().__init__(engine, connector)
        self.agent = agent  # its landing area, one slot per pool page, is what prefill workers WRITE into
        self._slots = LandingSlots(agent.area.shape[1] if agent is not None else 0)
        self.announced: set[tuple[str, int]] = set()  # (prefill, our agent's incarnation) told of it
        self.withdrawn: set[str] = set()  # prefills told to forget our replaced agent, not yet of the new
        # Requests whose KV is on the way, or whose abort awaits a drain.
        self.inbound: dict[str, Inbound] = {}
        self.routers: dict[str, str] = {}  # request id -> router to stream outputs to
        self.transfer_timeout_s, self.quarantine_s = transfer_timeout_s, QUARANTINE_S
        # Pages one tenant may hold while waiting for KV. By default half the pool (so one tenant's
        # reservations cannot take all of it), but never less than one request at the window holds.
        self.max_reserved_pages = max_reserved_pages or max(
            cdiv(engine.max_model_len, engine.pool.page_size), engine.pool.num_pages // 2
        )
        self.down_peers: set[str] = set()  # prefill workers whose connection is lost
        self.fenced: dict[str, float] = {}  # prefill -> until when it is refused (a quarantine it let expire)
        self.expired: Counter[str] = Counter()  # quarantines that expired, by prefill
        self._grammars: GrammarCompiler | None = None  # made at the first reserve with a guide
        self.forks: dict[str, tuple[str, int]] = {}  # n > 1: fork id -> (its request, its index)
        self.open_forks: dict[str, int] = {}  # request -> its forks not finished yet

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
        if (why := self.kv_refusal()) is not None:
            self._reject(sender, request_id, KV_UNAVAILABLE, f"This decode worker takes no KV: {why}.")
            return
        if message.prefill in self.down_peers or self.fenced.get(message.prefill, 0.0) > time.monotonic():
            self._reject(sender, request_id, "prefill_unavailable", "The prefill worker is unreachable.")
            return
        wanted = cdiv(len(prompt) - 1, self.engine.pool.page_size)
        if self._reserved_pages(message.tenant) + wanted > self.max_reserved_pages:
            self._reject(sender, request_id, SERVER_BUSY, "This tenant holds too many decode pages waiting.")
            return
        try:
            grammar = self._grammar(message)
            request = self.engine.reserve(prompt, message.sampling(), message.tenant, request_id, message.n)
        except AdmissionError as refusal:
            self.reply(sender, Rejected.of(request_id, refusal))
            return
        if request is None:
            self._reject(
                sender, request_id, SERVER_BUSY, "The decode pool has no free pages for this prompt."
            )
            return
        request.constrain(grammar)  # n > 1: a matcher for each fork
        self.routers[request_id] = sender
        if message.n > 1:
            self.forks.update((fork_id(request_id, i), (request_id, i)) for i in range(message.n))
            self.open_forks[request_id] = message.n
        targets = [[p, g] for p, g in zip(request.record.pages, request.record.generations, strict=True)]
        if len(prompt) == 1:  # no KV to transfer: the decode side computes the only token itself
            self.engine.resume(request_id)
        else:
            # Watched now, so its loss is noticed even before an abort.
            self.connector.connect(message.prefill)
            self._announce(message.prefill)
            grant = [(p, g) for p, g in targets]
            inbound = Inbound(sender, message.prefill, time.monotonic(), grant=grant)
            if self.agent is not None:  # the key goes to the assigned prefill alone, before any grant
                inbound.key, inbound.incarnation = new_key(), self.agent.incarnation
                self.reply(message.prefill, SealKey(request_id=request_id, key=inbound.key.hex()))
            self.inbound[request_id] = inbound
        self.reply(sender, Reserved(request_id=request_id, targets=targets))

    def _grammar(self, message: Reserve) -> RequestGrammar | None:
        """The reserve's guide compiled for this worker's tokenizer (a cached compile, then a copy of the
        matcher); AdmissionError 400 when it does not compile or the model has no tokenizer."""
        guide = message.output_guide()
        if guide is None:
            return None
        if self.engine.tokenizer is None:
            raise AdmissionError("invalid_request_error", "structured output needs the model's tokenizer")
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.engine.tokenizer, self.bounds.vocab_size)
        try:
            return self._grammars.for_guide(guide)
        except GrammarError as exc:
            raise AdmissionError("invalid_grammar", str(exc)) from None

    def _reject(self, router: str, request_id: str, code: str, why: str) -> None:
        self.reply(
            router, Rejected(request_id=request_id, code=code, message=f"{why} Retry later.", status=503)
        )

    def _reserved_pages(self, tenant: str) -> int:
        requests = (self.engine.requests.get(rid) for rid in self.inbound)
        return sum(len(r.record) for r in requests if r is not None and r.tenant == tenant)

    def on_abort(self, sender: str, message: Abort) -> None:
        """The router gave up (client gone, timeout) or prefill refused the request. Only the router that
        reserved the request may end it."""
        if self.routers.get(message.request_id, sender) != sender:
            self.drop(sender, "not_assigned", f"abort of {message.request_id} from another router")
            return
        forks = [f for f, (parent, _) in self.forks.items() if parent == message.request_id]
        for request_id in (message.request_id, *forks):  # after forking, the forks are what runs
            self._abort(request_id, message.reason)

    # ---- from the prefill worker ------------------------------------------------------------------------

    def on_page(self, sender: str, message: Page) -> None:
        request_id, page, generation = message.request_id, message.page, message.generation
        request = self.engine.requests.get(request_id)
        if not self.isolation:  # blindly, wherever the sender aimed, as many slots as it sent
            slots = min(self.engine.pool.page_size, len(message.payload) // self.engine.pool.token_bytes)
            self._write(page, slots, message.payload[: slots * self.engine.pool.token_bytes])
            self.engine.events.emit(
                request_id, "page_received", page=page, generation=generation, slots=slots, checked=False
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
        self.inbound[request_id].progress(time.monotonic())
        record, logical = request.record, message.logical
        if not 0 <= logical < len(record) or record.entry(logical) != (page, generation):
            self._refuse(request_id, page, "target is not in the request's record")
            self._abort(request_id, STALE_WRITE)
            return
        slots = self.engine.page_slots(
            request.num_tokens - 1, logical
        )  # from the token count, never the sender
        if (
            slots == 0
            or len(message.payload) != slots * self.engine.pool.token_bytes
            or xxhash.xxh3_64_intdigest(message.payload) != message.checksum
        ):
            self._refuse(request_id, page, "checksum mismatch")
            self._abort(request_id, CHECKSUM_MISMATCH)
            return
        if not self._authorized(record.tenant, page, generation):
            self.engine.events.emit(request_id, "write_refused", page=page, why="stale generation or owner")
            self._abort(request_id, STALE_WRITE)
            return
        self._write(page, slots, message.payload)
        self.inbound[request_id].progress(time.monotonic())
        self.engine.events.emit(request_id, "page_received", page=page, generation=generation, slots=slots)

    def _authorized(self, tenant: int, page: int, generation: int) -> bool:
        """A fenced write of a page's slots from 0: the generation granted, the tenant's, exclusive, empty."""
        one = np.array([page])
        return bool(
            self.engine.pool.authorize_writes(one, np.array([generation]), np.array([tenant]), one * 0)[0]
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
        inbound = self.inbound[request_id]
        inbound.progress(time.monotonic())
        if message.failed:
            self._abort(request_id, message.failed)
            return
        if message.checksums is not None and message.pages and message.agent not in inbound.notifiers:
            # DONE at prefill is not landed here: wait for the notification of the agent that wrote
            inbound.complete = message
            inbound.to(Phase.COMPLETING, time.monotonic())
            return
        self._complete(request_id, message)

    def _complete(self, request_id: str, message: Complete) -> None:
        """The transfer is over: open and copy in one-sided pages, check the handoff, resume."""
        request, inbound = self.engine.requests[request_id], self.inbound[request_id]
        tokens = request.num_tokens - 1
        if foreign := len(inbound.notifiers - {message.agent}):  # forged: UCX authenticates no agent
            self.rejected["foreign_notification"] += foreign
        if message.checksums is not None:
            reason = self._copy_in(request_id, message.checksums)
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
        self._drain(request_id, "abort_ack")

    def on_link(self, event: LinkEvent) -> None:
        """This worker's own connection to a prefill worker: when it is gone, nothing more can arrive from
        it, so its quarantined pages can be released (a restarted worker's writes name old generations and
        are refused); while it is gone, reservations naming it are refused."""
        if event.up:
            self.down_peers.discard(event.peer)
            return
        self.down_peers.add(event.peer)
        # A restarted worker has a new agent that does not know ours.
        self.announced = {(peer, n) for peer, n in self.announced if peer != event.peer}
        for request_id, inbound in list(self.inbound.items()):
            if inbound.prefill == event.peer:
                self._abort(request_id, "prefill_lost")
                self._drain(request_id, "peer_down")

    # ---- decode output and deadlines --------------------------------------------------------------------

    def after_step(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send_output(output)

    def tick(self, now: float) -> None:
        if self.agent is not None:
            self._reannounce()
        for note in self.agent.notified() if self.agent is not None else []:
            self._landed(note)
        incarnation = self.agent.incarnation if self.agent is not None else None
        for request_id, inbound in list(self.inbound.items()):
            if self.inbound.get(request_id) is not inbound:
                continue  # ended by an earlier entry's expiry
            due = inbound.due(now, self.transfer_timeout_s, self.quarantine_s, incarnation)
            if due == "quarantine_expired":
                self._expire(inbound.prefill, now)
            elif due is not None:
                # A grant nothing can have written into (no page, no `complete`, no key sent) must not pin
                # the pool: released. One that may have been written is quarantined, with its deadline.
                self._abort(request_id, due, release=not inbound.may_be_written)

    def _reannounce(self) -> None:
        """A replaced landing process: every prefill that knew the old one is told to forget it at once
        (ZeroMQ frames meanwhile: WRITEs to a process that is gone would fail), then learns the new one
        as soon as it serves, not at its next grant."""
        assert self.agent is not None
        stale = {p for p, n in self.announced if n != self.agent.incarnation}
        self.announced = {(p, n) for p, n in self.announced if p not in stale}
        if not self.agent.serving:
            for prefill in stale - self.withdrawn:
                self.reply(prefill, KvAgent(0, 0, 0, b""))
            self.withdrawn |= stale
            return
        for prefill in (stale | self.withdrawn) - self.down_peers:
            self._announce(prefill)
        self.withdrawn.clear()

    def _expire(self, prefill: str, now: float) -> None:
        """A prefill let a quarantine expire (it neither acknowledged the abort nor lost its link): every
        transfer of it is drained or released (its pages come back under new generations, so a late page
        names a generation no record holds, and a late one-sided WRITE lands in a slot that opens under no
        key this worker will hold again), and it is refused for PEER_FENCE_S."""
        self.expired[prefill] += 1
        self.rejected["quarantine_expired"] += 1
        self.fenced[prefill] = now + PEER_FENCE_S
        log.warning("decode: prefill %s let a quarantine expire; fenced off %.0f s", prefill, PEER_FENCE_S)
        for request_id, inbound in list(self.inbound.items()):
            if inbound.prefill != prefill:
                continue
            if inbound.phase is not Phase.QUARANTINED:
                self._abort(request_id, "prefill_fenced", release=True)
            self._drain(request_id, "quarantine_expired")

    # ---- one-sided writes (NIXL) ------------------------------------------------------------------------

    def _announce(self, prefill: str) -> None:
        """Send a prefill worker our NIXL agent and landing area, once per connection, on the authenticated
        channel, before the first grant it will write into (the router sends `prefill` after `reserved`)."""
        if self.agent is None or (prefill, self.agent.incarnation) in self.announced:
            return
        try:
            metadata = self.agent.metadata()
        except LandingError:  # restarting: this prefill's pages go as ZeroMQ frames or fail closed
            return
        area = self.agent.layout
        self.reply(prefill, KvAgent(area.base, area.slots, area.slot_bytes, metadata))
        self.announced.add((prefill, self.agent.incarnation))

    def _landed(self, note: Notification) -> None:
        """A WRITE's notification: its bytes are in the landing slots (a claim: the pages must still open).
        A `complete` that came first is handled now, if the notification is from the agent it names."""
        inbound = self.inbound.get(note.request_id)
        if inbound is None or inbound.phase is Phase.QUARANTINED:
            return  # a late or forged write: it reached landing slots only
        inbound.notified_by(note.agent)
        if inbound.phase is Phase.GRANTED:
            inbound.progress(time.monotonic())
        complete = inbound.complete
        if complete is not None and complete.agent == note.agent:
            self._complete(note.request_id, complete)

    def _copy_in(self, request_id: str, checksums: list[int]) -> str | None:
        """The one-sided handoff: every page covering the prompt opens from its landing slot under the
        request's key for exactly its slot and is copied into the pool by a fenced write; the landing
        slot is cleared. With isolation off, whatever opens is copied in and nothing is checked."""
        assert self.agent is not None
        request, inbound = self.engine.requests[request_id], self.inbound[request_id]
        tokens, record = request.num_tokens - 1, request.record
        needed = cdiv(tokens, self.engine.pool.page_size)
        if self.isolation and (len(checksums) != needed or len(record) < needed):
            return INCOMPLETE_HANDOFF
        for logical in range(min(needed, len(record), len(checksums))):
            page, generation = record.entry(logical)
            slots = self.engine.page_slots(tokens, logical)
            plain_bytes = slots * self.engine.pool.token_bytes
            key = inbound.key
            plain = self._slots.take(self.agent.area, page, plain_bytes, key, request_id, logical, generation)
            if not self.isolation:
                if plain is not None:
                    self._write(page, slots, plain)
                continue
            if plain is None:
                torn = self._slots.torn(checksums[logical])
                self._refuse(request_id, page, "torn or lost in transport" if torn else "does not open")
                return CHECKSUM_MISMATCH
            if not self._authorized(record.tenant, page, generation):
                self.engine.events.emit(
                    request_id, "write_refused", page=page, why="stale generation or owner"
                )
                return STALE_WRITE
            self._write(page, slots, plain)
            self.engine.events.emit(
                request_id, "page_received", page=page, generation=generation, slots=slots, sealed=True
            )
        return None

    def _drain(self, request_id: str, how: str) -> None:
        """Release a quarantined request and forget its transfer; its landing slots are cleared (a write
        that lands there later still opens under no key decode will ever hold again)."""
        inbound = self.inbound.pop(request_id, None)
        if self.agent is not None and inbound is not None:
            self.agent.area[[page for page, _ in inbound.grant]] = 0
        self.engine.drain(request_id, how)

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()

    # ---- helpers ----------------------------------------------------------------------------------------

    def _write(self, page: int, slots: int, payload: bytes) -> None:
        """The first `slots` slots of `page` (authorised by the caller, or isolation is off)."""
        self.engine.pool.load_page_bytes(page, payload, slots)
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
            else:
                inbound.to(Phase.QUARANTINED, time.monotonic())
        if output is not None:
            self._send_output(output)

    def _send_output(self, output: RequestOutput) -> None:
        """To the router that reserved the request; a fork's output under its request's id with its index.
        The router's entry goes when the request ends: it finished or was aborted before forking, or its
        last fork finished."""
        request_id, fork = self.forks.get(output.request_id, (output.request_id, None))
        router = self.routers.get(request_id)
        if router is None:
            return
        if output.finished and (fork is None or self._last_fork(request_id)):
            del self.routers[request_id]
            self.open_forks.pop(request_id, None)
            self.forks = {f: owner for f, owner in self.forks.items() if owner[0] != request_id}
        self.reply(router, to_wire(output, request_id, fork))

    def _last_fork(self, request_id: str) -> bool:
        self.open_forks[request_id] -= 1
        return self.open_forks[request_id] == 0
