"""The router: the OpenAI-compatible front of N prefill workers and M decode workers.

It implements the server's EngineClient, so the HTTP layer (auth, errors, SSE) is the single-node one.
Per request: choose a pair (the reachable prefill and decode worker whose pools fit the request, each
of those with room for it the least loaded by the tokens the router has in flight there, `placement.py`;
ties go to the first listed, so the choice is deterministic), fail-closed admission against the window and
THAT pair's pools (before anything is reserved), then decode `reserve` -> prefill `prefill` (with decode's
targets) -> decode's outputs streamed back. Leaving early (client gone, router timeout) sends the pair's
decode `abort`; decode then quarantines and drains. A worker whose link drops takes only its own
requests with it (a decode's streams end with `decode_lost`; a prefill's are ended by their decode) and
is chosen again once it has said hello after its link came back up.

Workers are named by role and position (`worker_names`): `prefill` and `decode` for one of each, else
`prefill-0`, `decode-1`...; the names label /v1/audit/info's pools, /metrics' `role` and the trails'
`where`.

All sockets live on one I/O thread; asyncio callers talk to it through a queue and futures. That thread
trusts nothing it receives: a frame is parsed into its declared type, its authenticated sender must have
the role that may send that kind, a reply must answer a question this router asked that very worker, and
a request's messages must come from the worker it was sent to. Everything else is dropped and counted;
no frame can end the thread (`alive` says whether it runs, and /health with it), and no send can block it
(`_send_now`). What a reply says is untrusted too (a worker's key may be stolen): its stats, audit events,
pool and pins go through `replies.py` before anything uses them, and what it drops or caps is counted as
`bad_reply`. The reports of the workers (/v1/audit/info, stats, a request's trail) are `reports.py`'s.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from kvfence.disagg import replies
from kvfence.disagg.connector import Connector, LinkEvent, Received, ZmqConnector
from kvfence.disagg.keys import TransportKeys, worker_names
from kvfence.disagg.messages import (
    KV_UNAVAILABLE,
    ROLE_RULES,
    Abort,
    BadMessage,
    Bounds,
    Hello,
    HelloReply,
    Msg,
    Output,
    Prefill,
    Rejected,
    Reserve,
    accept,
)
from kvfence.disagg.outputs import aborted, from_wire
from kvfence.disagg.placement import Placement, Route, WorkerInfo
from kvfence.disagg.questions import Answered, Questions
from kvfence.disagg.reports import WorkerReports
from kvfence.engine.async_engine import STATS_TIMEOUT_S
from kvfence.engine.engine import AdmissionError, duplicate_refusal
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.grammar.compiler import Guide, RequestGrammar
from kvfence.model.tokenizer import Tokenizer
from kvfence.sampling import SamplingParams
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FaultInjector

Reply = TypeVar("Reply", bound=Msg)
ROUTER_TIMEOUT_S = 120.0  # no message from the workers for this long: the router gives up on the request
IO_WAIT_S = 0.05  # the I/O thread's longest wait for a frame (an outgoing message wakes it at once)
log = logging.getLogger("kvfence.disagg")


class Router:
    # Decode samples every token, so its outputs carry their logprobs; the prompt's logits are prefill's,
    # which reports none: prompt_logprobs stay refused here (the API checks supports_prompt_logprobs).
    supports_logprobs = True
    supports_grammar = True  # the guide goes to decode, which compiles and enforces it
    supports_parallel_sampling = True  # n goes to decode, which forks the computed prompt

    def __init__(
        self,
        prefill: str | Sequence[str],
        decode: str | Sequence[str],
        tokenizer: Tokenizer,
        vocab_size: int,
        isolation: bool = True,
        listen: str = "tcp://127.0.0.1:0",
        events: EventLog | None = None,
        faults: FaultInjector | None = None,
        timeout_s: float = ROUTER_TIMEOUT_S,
        keys: TransportKeys | None = None,
        max_capacity_tokens: int = replies.MAX_CAPACITY_TOKENS,
    ) -> None:
        """`max_capacity_tokens`: the largest pool the router believes a worker has; a larger claim is
        capped (`replies.worker`)."""
        prefills = [prefill] if isinstance(prefill, str) else list(prefill)
        decodes = [decode] if isinstance(decode, str) else list(decode)
        if not prefills or not decodes or len(set(prefills + decodes)) != len(prefills) + len(decodes):
            raise ValueError("a router needs at least one prefill and one decode worker, each address once")
        self.by_role = {"prefill": prefills, "decode": decodes}
        names = worker_names("prefill", len(prefills)) + worker_names("decode", len(decodes))
        self.addresses: dict[str, str] = dict(zip(names, prefills + decodes, strict=True))  # name -> address
        self.names = {address: name for name, address in self.addresses.items()}
        self.roles = {address: role for role, group in self.by_role.items() for address in group}
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.isolation = isolation
        self.events = events or EventLog()
        self.faults = faults or FaultInjector()
        self.timeout_s = timeout_s
        self.max_capacity_tokens = max_capacity_tokens
        self._listen, self._keys = listen, keys
        self._outbox: queue.Queue[tuple[str, Msg]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Msg]]] = {}
        self.placement = Placement(self.by_role, self.names, isolation)
        self.questions = Questions()  # asked by callers' threads, answered by the I/O thread
        self.rejected: Counter[str] = Counter()  # frames dropped by the I/O thread, by reason
        # `bad_reply` is counted by callers' threads too (stats, audit); every other reason by the I/O
        # thread alone, so this lock guards that one count.
        self._bad_reply_lock = threading.Lock()
        self._bounds = Bounds(max_tokens=1 << 20, vocab_size=vocab_size)
        self._stopped = threading.Event()
        self._started = threading.Event()  # every pool learnt: reconnections are adopted from now on
        self._ready: concurrent.futures.Future[Connector] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._loop, name="kvfence-router", daemon=True)
        self.reports = WorkerReports(
            self.addresses,
            self.placement,
            self.events,
            self.rejected,
            keys is not None,
            self._ask,
            self._drop_items,
        )

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, learn every worker's pool, and refuse to run if they cannot serve the window."""
        self._thread.start()
        self._ready.result(timeout=STATS_TIMEOUT_S)
        for name, address in self.addresses.items():
            role = self.roles[address]
            reply = self._ask(address, lambda token: Hello(token=token), HelloReply)
            if reply.role != role:
                raise RuntimeError(f"{address} answers as a {reply.role} worker, not {role}")
            worker, problems = replies.worker(reply, None, self.max_capacity_tokens)  # mismatch() compares
            self._drop_items(address, problems)
            if worker is None:
                raise RuntimeError(f"{address}: {problems[-1]}")
            self.placement.workers[name] = worker
        problem = self.placement.mismatch()
        if problem is not None:
            raise RuntimeError(problem)
        self.placement.max_model_len = self.placement.window()
        self._bounds = Bounds(max_tokens=self.max_model_len, vocab_size=self.vocab_size)
        self._started.set()

    @property
    def max_model_len(self) -> int:
        """The advertised window (Placement.window), known once every worker said hello."""
        return self.placement.max_model_len

    @property
    def workers(self) -> dict[str, WorkerInfo]:
        return self.placement.workers

    def shutdown(self) -> None:
        self._stopped.set()
        if self._ready.done() and self._ready.exception() is None:
            self._ready.result().wake()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        """The I/O thread runs: without it no request can be served (/health answers 503)."""
        return self._thread.is_alive()

    def health(self) -> dict[str, Any]:
        return {"workers": self.placement.health()}

    @property
    def down(self) -> set[str]:
        """The names of the workers whose link is lost now (until they say hello again)."""
        return {self.names[address] for address in list(self.placement.down)}

    def describe(self) -> str:
        pools = ", ".join(f"{name} pool {w.capacity_tokens} tokens" for name, w in self.workers.items())
        return f"{pools}, context window {self.max_model_len} tokens"

    # ---- EngineClient -----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tenant: str,
        request_id: str,
        grammar: RequestGrammar | None = None,
        n: int = 1,
    ) -> AsyncIterator[RequestOutput]:
        """As the single node's; `grammar` travels as the guide it was compiled from, `n` to decode. With
        n > 1 the outputs are the forks' (`index`), until all n finished or the request ended unforked.
        An id a request in flight here holds is refused (AdmissionError 409) before anything is recorded or
        sent: that request's stream, route and workers' state stay its own."""
        if request_id in self._streams:
            raise duplicate_refusal(request_id)
        try:
            route = self.placement.choose(len(prompt_token_ids), params.max_tokens)
        except AdmissionError as refusal:
            self.events.emit(request_id, "rejected", reason=refusal.code, tenant=tenant, where="router")
            raise
        self.events.emit(
            request_id,
            "admitted",
            tenant=tenant,
            prompt_tokens=len(prompt_token_ids),
            prefill=self.names[route.prefill],
            decode=self.names[route.decode],
            where="router",
        )
        stream: asyncio.Queue[Msg] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        self.placement.take(request_id, route)
        finished = False
        try:
            guide = None if grammar is None else grammar.guide
            await self._handoff(request_id, prompt_token_ids, params, tenant, stream, guide, n)
            running = n
            while not finished:
                message = await self._next(stream, request_id)
                fork = getattr(message, "fork", None)
                if fork is not None and fork >= n:  # a choice this request has not: fail it closed
                    self._drop(route.decode, "bad_field", f"output of choice {fork} of {request_id} (n={n})")
                    self._send(route.decode, Abort(request_id=request_id, reason="bad_reply"))
                    message, fork = aborted(request_id, "bad_reply"), None
                output = from_wire(message)
                self.placement.release_prefill(route)
                if output.finished:
                    running -= 1
                    finished = fork is None or running == 0
                yield output
        finally:
            self._streams.pop(request_id, None)
            self.placement.release(request_id, route)
            if not finished:
                self._send(route.decode, Abort(request_id=request_id, reason="client_disconnected"))

    async def _handoff(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        stream: asyncio.Queue[Msg],
        guide: Guide | None,
        n: int,
    ) -> None:
        """Reserve on the pair's decode, then start its prefill; AdmissionError when either refuses."""
        route = self.placement.routes[request_id]
        shape = None if guide is None else {"kind": guide.kind, "spec": guide.spec}
        reserve = Reserve(request_id, tenant, prompt, dict(params.__dict__), route.prefill, shape, n)
        self._send(route.decode, reserve)
        reply = await self._next(stream, request_id)
        if isinstance(reply, Rejected):
            self._note_no_kv(route.decode, reply)
            raise AdmissionError(reply.code, reply.message, reply.status)
        if isinstance(reply, Output):  # the router already gave up waiting for the reservation
            stream.put_nowait(reply)
            return
        if len(prompt) == 1:  # no KV to move: decode computes the only prompt token itself
            return
        targets = getattr(reply, "targets")  # noqa: B009 - a Reserved: the only other reply to a reserve
        self._send(route.prefill, Prefill(request_id, tenant, prompt, route.decode, targets))
        reply = await self._next(stream, request_id)
        if isinstance(reply, Rejected):
            self._note_no_kv(route.prefill, reply)
            self._send(route.decode, Abort(request_id=request_id, reason="prefill_rejected"))
            raise AdmissionError(reply.code, reply.message)
        if isinstance(reply, Output):  # decode ended it first (prefill worker lost), or the router gave up
            stream.put_nowait(reply)
            return
        if self.faults.fire("abort_mid_transfer"):
            self.events.emit(request_id, "fault_injected", fault="abort_mid_transfer", where="router")
            stream.put_nowait(self._give_up(request_id, "router_gave_up"))

    def _note_no_kv(self, address: str, refusal: Rejected) -> None:
        """A worker that takes no KV gets nothing more placed on it until its next hello."""
        if refusal.code == KV_UNAVAILABLE:
            self.placement.no_kv[address] = refusal.message[:200]
            log.error("router: %s takes no KV: %s", self.names[address], refusal.message[:200])

    async def _next(self, stream: asyncio.Queue[Msg], request_id: str) -> Msg:
        """The request's next message, or the router's own abort after `timeout_s` of silence."""
        try:
            return await asyncio.wait_for(stream.get(), self.timeout_s)
        except TimeoutError:
            return self._give_up(request_id, "router_timeout")

    def _give_up(self, request_id: str, reason: str) -> Output:
        """Stop waiting: decode is told to abort (it quarantines whatever may still arrive), and the client
        gets an error naming the request."""
        self.events.emit(request_id, "aborted", reason=reason, where="router")
        route = self.placement.routes.get(request_id)
        if route is not None:
            self._send(route.decode, Abort(request_id=request_id, reason=reason))
        return aborted(request_id, reason)

    def info(self) -> dict[str, Any]:
        return self.reports.info()

    def stats(self) -> dict[str, EngineStats]:
        return self.reports.stats()

    def worker_stats(self, name: str) -> EngineStats:
        """One worker's pool and fence counters (blocking); BadReply when its answer is unusable."""
        return self.reports.worker_stats(name)

    def audit_events(self, request_id: str) -> list[dict[str, Any]]:
        return self.reports.audit_events(request_id)

    # ---- the I/O thread ---------------------------------------------------------------------------------

    def _send(self, peer: str, message: Msg) -> None:
        self._outbox.put((peer, message))
        self._ready.result().wake()  # the I/O thread sends it now, not when its wait ends

    def _ask(self, peer: str, question: Callable[[str], Msg], answer: type[Reply]) -> Reply:
        """A blocking request/reply with a worker (never call it on the event loop): only an `answer`,
        from that worker, carrying this question's token, answers it."""
        token, future = self.questions.ask(peer, answer.KIND)
        self._send(peer, question(token))
        try:
            reply = future.result(timeout=STATS_TIMEOUT_S)
        finally:
            self.questions.close(token)
        assert isinstance(reply, answer)  # _answer checked its kind
        return reply

    def _loop(self) -> None:
        connector = ZmqConnector(self._listen, self._keys)
        for peer in self.addresses.values():
            connector.connect(peer)
        self._ready.set_result(connector)
        try:
            while not self._stopped.is_set():
                while not self._outbox.empty():
                    self._send_now(connector, *self._outbox.get_nowait())
                received = connector.recv(IO_WAIT_S)
                if received is not None:
                    self._dispatch_safely(received)
                self.rejected.update(connector.rejected)
                connector.rejected.clear()
        finally:
            connector.close()

    def _send_now(self, connector: Connector, peer: str, message: Msg) -> None:
        """Send on the I/O thread, which a send never blocks. A message the connector dropped (the worker is
        not taking its frames: counted as `send_blocked`) fails what waits on it now: a question's asker
        gets TimeoutError (a lost hello after a reconnection keeps that worker out until its next link up),
        and a request whose `reserve` or `prefill` was lost ends (`send_blocked`), decode told to abort. A
        lost `abort` leaves nothing to fail: its request is over here already."""
        if connector.send(peer, message):
            return
        token = getattr(message, "token", None)
        if token is not None:
            self.questions.fail(
                token, TimeoutError(f"{message.KIND} to {self.names.get(peer, peer)} could not be sent")
            )
        elif isinstance(message, Reserve | Prefill):
            self._end_stream(message.request_id, "send_blocked")

    def _end_stream(self, request_id: str, reason: str) -> None:
        """End a request's stream from the I/O thread (`_give_up`), if its caller is still there."""
        if self._live_stream(request_id):
            self._deliver(request_id, self._give_up(request_id, reason))

    def _live_stream(self, request_id: str) -> bool:
        """Whether the request's caller is still there to be handed a message."""
        target = self._streams.get(request_id)
        return target is not None and not target[0].is_closed()

    def _deliver(self, request_id: str, message: Msg) -> None:
        """Hand a message to the request's stream from the I/O thread, if its caller is still there."""
        if self._live_stream(request_id):
            loop, stream = self._streams[request_id]
            loop.call_soon_threadsafe(stream.put_nowait, message)

    def _dispatch_safely(self, item: Received | LinkEvent) -> None:
        """No frame may end the one I/O thread: whatever a handler raises is logged and counted."""
        try:
            if isinstance(item, LinkEvent):
                self._on_link(item)
            else:
                self._dispatch(item)
        except Exception:
            self.rejected["handler_error"] += 1
            log.exception("router: a frame from %s could not be handled", getattr(item, "sender", "?"))

    def _drop(self, sender: str, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        log.warning("router: dropped a frame from %s (%s): %s", sender, reason, detail)

    def _drop_items(self, sender: str, problems: list[str]) -> None:
        """Count each item of a reply that `replies` dropped or capped, and log them once per reply (a
        reply may carry thousands of bad events)."""
        if not problems:
            return
        with self._bad_reply_lock:
            self.rejected["bad_reply"] += len(problems)
        shown = "; ".join(problems[:3]) + ("; ..." if len(problems) > 3 else "")
        log.warning(
            "router: %d item(s) of a reply from %s not taken (bad_reply): %s", len(problems), sender, shown
        )

    def _dispatch(self, item: Received) -> None:
        try:
            message = accept(item.header, item.payload, item.role, "router", self._bounds)
        except BadMessage as exc:
            self._drop(item.sender, exc.reason, str(exc))
            return
        token = getattr(message, "token", None)
        if token is not None:
            self._answer(item.sender, token, message)
            return
        request_id = getattr(message, "request_id", "")
        if item.sender not in self._senders(message.KIND, self.placement.routes.get(request_id)):
            self._drop(item.sender, "not_assigned", f"{message.KIND} from a worker not assigned to it")
            return
        self._deliver(request_id, message)

    def _senders(self, kind: str, route: Route | None) -> set[str]:
        """Who may send a request's message of `kind`: the worker of that role in its pair; for a request
        no longer in flight, any worker of that role (its message is then ignored)."""
        roles = ROLE_RULES["router"][kind]
        if route is None:
            return {address for role in roles for address in self.by_role[role]}
        return {route.prefill if role == "prefill" else route.decode for role in roles}

    def _answer(self, sender: str, token: str, reply: Msg) -> None:
        """A reply is taken only as the answer to a question this router asked that worker."""
        answered = self.questions.take(sender, token, reply)
        if answered is Answered.UNSOLICITED:
            self._drop(sender, "unsolicited", f"{reply.KIND} answering no question of ours")
        elif answered is Answered.UNAWAITED:  # the hello sent when the worker's connection came back up
            assert isinstance(reply, HelloReply)
            self._adopt(sender, reply)

    def _on_link(self, event: LinkEvent) -> None:
        if event.up:
            # A link that was never down is the first connection, whose hello start() asks itself (this
            # event may come after it: the I/O thread reads frames before monitor events). One that was
            # down may be a new process: it stays down until its hello is in.
            if event.peer not in self.placement.down:
                return
            self._send(event.peer, Hello(token=self.questions.ask_unawaited(event.peer, HelloReply.KIND)))
            return
        self.placement.down.add(event.peer)
        if self.roles.get(event.peer) == "decode":
            self._fail_streams_of(event.peer, "decode_lost")

    def _adopt(self, address: str, hello: HelloReply) -> None:
        """A (re)connected worker's hello, bounded (`replies.worker`) and taken by placement (`adopt`); a
        refused one stays down."""
        if not self._started.is_set():  # start() is still learning the pools; it asks for itself
            return
        role, name = self.roles[address], self.names[address]
        if hello.role != role:
            self._drop_items(address, [f"hello as a {hello.role} worker, not {role}"])
            return
        agreed = self.placement.workers[name].page_size  # start() made every worker agree on one
        worker, problems = replies.worker(hello, agreed, self.max_capacity_tokens)
        self._drop_items(address, problems)
        refusal = problems[-1] if worker is None else self.placement.adopt(name, worker)
        if refusal is not None:
            log.error("router: %s refused after reconnecting: %s", name, refusal)
            self.placement.down.add(address)
            return
        self.placement.down.discard(address)
        self.placement.no_kv.pop(address, None)  # a new process, with a landing process of its own

    def _fail_streams_of(self, decode: str, reason: str) -> None:
        """A decode worker is gone: every request it held ends with an error, none hangs; the other
        workers' requests go on."""
        for request_id, route in list(self.placement.routes.items()):
            if route.decode == decode:
                self._deliver(request_id, aborted(request_id, reason))
