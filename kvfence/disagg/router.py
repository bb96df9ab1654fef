"""The router: the OpenAI-compatible front of a prefill worker and a decode worker.

It implements the server's EngineClient, so the HTTP layer (auth, errors, SSE) is the single-node one.
Per request: fail-closed admission against the window and BOTH pools (before anything is reserved), then
decode `reserve` -> prefill `prefill` (with decode's targets) -> decode's outputs streamed back. Leaving
early (client gone, router timeout) sends decode `abort`; decode then quarantines and drains.

All sockets live on one I/O thread; asyncio callers talk to it through a queue and futures.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvfence.disagg.connector import PEER_DOWN, PEER_UP, Connector, Message, ZmqConnector
from kvfence.engine.async_engine import STATS_TIMEOUT_S
from kvfence.engine.engine import AdmissionError, context_refusal
from kvfence.engine.output import RequestOutput
from kvfence.engine.stats import EngineStats
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import code_info
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.trail.events import EventLog
from kvfence.trail.faults import FaultInjector

ROUTER_TIMEOUT_S = 120.0  # no message from the workers for this long: the router gives up on the request
REHELLO = "rehello"  # token of the hello the router sends a worker whose connection came (back) up

log = logging.getLogger("kvfence.disagg")


@dataclass(frozen=True)
class WorkerInfo:
    role: str
    capacity_tokens: int
    max_model_len: int
    page_size: int
    isolation: bool
    info: dict[str, Any]  # the worker's engine_info, for /v1/audit/info

    @classmethod
    def from_hello(cls, fields: dict[str, Any]) -> WorkerInfo:
        keys = ("role", "capacity_tokens", "max_model_len", "page_size", "isolation", "info")
        return cls(*(fields[key] for key in keys))


class Router:
    def __init__(
        self,
        prefill: str,
        decode: str,
        tokenizer: Tokenizer,
        vocab_size: int,
        isolation: bool = True,
        listen: str = "tcp://127.0.0.1:0",
        events: EventLog | None = None,
        faults: FaultInjector | None = None,
        timeout_s: float = ROUTER_TIMEOUT_S,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.isolation = isolation
        self.events = events or EventLog()
        self.faults = faults or FaultInjector()
        self.timeout_s = timeout_s
        self._listen = listen
        self._outbox: queue.Queue[tuple[str, Message]] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Message]]] = {}
        self._replies: dict[str, concurrent.futures.Future[Message]] = {}
        self._tokens = itertools.count()
        self._stopped = threading.Event()
        self._started = threading.Event()  # both pools learnt: reconnections are adopted from now on
        self._ready: concurrent.futures.Future[Connector] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._loop, name="kvfence-router", daemon=True)
        self.workers: dict[str, WorkerInfo] = {}
        self.max_model_len = 0
        # Workers whose connection is lost now. Written on the I/O thread, read by callers (a set lookup).
        self._down: set[str] = set()

    # ---- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect, learn both workers' pools, and refuse to run if they cannot serve the window."""
        self._thread.start()
        self._ready.result(timeout=STATS_TIMEOUT_S)
        for role, address in (("prefill", self.prefill), ("decode", self.decode)):
            self.workers[role] = WorkerInfo.from_hello(self._ask(address, "hello").fields)
        problem = self._mismatch()
        if problem is not None:
            raise RuntimeError(problem)
        self.max_model_len = self._window()
        self._started.set()

    def _mismatch(self) -> str | None:
        prefill, decode = self.workers["prefill"], self.workers["decode"]
        if prefill.page_size != decode.page_size:
            return f"page sizes differ: prefill {prefill.page_size}, decode {decode.page_size}"
        return None

    def _window(self) -> int:
        # With isolation off the router advertises decode's window alone, as the incident's deployment did.
        prefill, decode = self.workers["prefill"], self.workers["decode"]
        return min(prefill.max_model_len, decode.max_model_len) if self.isolation else decode.max_model_len

    def shutdown(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=10)

    def describe(self) -> str:
        p, d = self.workers["prefill"], self.workers["decode"]
        return (
            f"prefill pool {p.capacity_tokens} tokens, decode pool {d.capacity_tokens} tokens, "
            f"context window {self.max_model_len} tokens"
        )

    # ---- EngineClient -----------------------------------------------------------------------------------

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: str, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        refusal = self._unavailable() or self._admission_refusal(len(prompt_token_ids), params.max_tokens)
        if refusal is not None:
            self.events.emit(request_id, "rejected", reason=refusal.code, where="router")
            raise refusal
        self.events.emit(
            request_id, "admitted", tenant=tenant, prompt_tokens=len(prompt_token_ids), where="router"
        )
        stream: asyncio.Queue[Message] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            await self._handoff(request_id, prompt_token_ids, params, tenant, stream)
            while not finished:
                output = _output(await self._next(stream, request_id))
                finished = output.finished
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._send(self.decode, "abort", request_id=request_id, reason="client_disconnected")

    async def _handoff(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        tenant: str,
        stream: asyncio.Queue[Message],
    ) -> None:
        """Reserve on decode, then start prefill; AdmissionError when either refuses."""
        self._send(
            self.decode,
            "reserve",
            request_id=request_id,
            tenant=tenant,
            prompt=prompt,
            params=params.__dict__,
            prefill=self.prefill,
        )
        reply = await self._next(stream, request_id)
        if reply.kind == "rejected":
            raise AdmissionError(
                reply.fields["code"], reply.fields["message"], reply.fields.get("status", 400)
            )
        if reply.kind == "output":  # the router already gave up waiting for the reservation
            stream.put_nowait(reply)
            return
        if len(prompt) == 1:  # no KV to move: decode computes the only prompt token itself
            return
        self._send(
            self.prefill,
            "prefill",
            request_id=request_id,
            tenant=tenant,
            prompt=prompt,
            decode=self.decode,
            targets=reply.fields["targets"],
        )
        reply = await self._next(stream, request_id)
        if reply.kind == "rejected":
            self._send(self.decode, "abort", request_id=request_id, reason="prefill_rejected")
            raise AdmissionError(reply.fields["code"], reply.fields["message"])
        if reply.kind == "output":  # decode ended it first (prefill worker lost), or the router gave up
            stream.put_nowait(reply)
            return
        if self.faults.fire("abort_mid_transfer"):
            self.events.emit(request_id, "fault_injected", fault="abort_mid_transfer", where="router")
            stream.put_nowait(self._give_up(request_id, "router_gave_up"))

    async def _next(self, stream: asyncio.Queue[Message], request_id: str) -> Message:
        """The request's next message, or the router's own abort after `timeout_s` of silence."""
        try:
            return await asyncio.wait_for(stream.get(), self.timeout_s)
        except TimeoutError:
            return self._give_up(request_id, "router_timeout")

    def _give_up(self, request_id: str, reason: str) -> Message:
        """Stop waiting: decode is told to abort (it quarantines whatever may still arrive), and the client
        gets an error naming the request."""
        self.events.emit(request_id, "aborted", reason=reason, where="router")
        self._send(self.decode, "abort", request_id=request_id, reason=reason)
        return _aborted(request_id, reason)

    def _unavailable(self) -> AdmissionError | None:
        """A lost worker: answer 503 at once instead of queueing the request for its restart."""
        for role, address in (("decode", self.decode), ("prefill", self.prefill)):
            if address in self._down:
                message = f"The {role} worker is unreachable; retry later."
                return AdmissionError(f"{role}_unavailable", message, 503)
        return None

    def _admission_refusal(self, prompt: int, budget: int) -> AdmissionError | None:
        """Invariant 3 across processes: the window, and (isolation on) both pools, before any reservation.
        With isolation off only the window is checked, as the incident's router did."""
        limits = [("This model's maximum context length is", self.max_model_len, prompt + budget)]
        if self.isolation:
            limits += [
                ("The prefill KV pool holds", self.workers["prefill"].capacity_tokens, prompt),
                ("The decode KV pool holds", self.workers["decode"].capacity_tokens, prompt + budget),
            ]
        return context_refusal(prompt, budget, limits)

    def info(self) -> dict[str, Any]:
        return {
            "mode": "disaggregated",
            "transport": "zeromq",
            "max_model_len": self.max_model_len,
            "router": code_info(),
            "pools": {role: worker.info for role, worker in self.workers.items()},
        }

    def stats(self) -> EngineStats:
        prefill, decode = (
            EngineStats.from_dict(self._ask(a, "stats").fields["stats"]) for a in (self.prefill, self.decode)
        )
        return prefill + decode

    def audit_events(self, request_id: str) -> list[dict[str, Any]]:
        """The request's trail across router, prefill and decode, in time order."""
        events = [{**e, "where": "router"} for e in self.events.for_request(request_id)]
        for address in (self.prefill, self.decode):
            events += self._ask(address, "audit", request_id=request_id).fields["events"]
        return sorted(events, key=lambda e: e["ts"])

    # ---- the I/O thread ---------------------------------------------------------------------------------

    def _send(self, peer: str, kind: str, **fields: Any) -> None:
        self._outbox.put((peer, Message(kind, fields)))

    def _ask(self, peer: str, kind: str, **fields: Any) -> Message:
        """A blocking request/reply with a worker (never call it on the event loop)."""
        token = f"q{next(self._tokens)}"
        future: concurrent.futures.Future[Message] = concurrent.futures.Future()
        self._replies[token] = future
        self._send(peer, kind, token=token, **fields)
        try:
            return future.result(timeout=STATS_TIMEOUT_S)
        finally:
            self._replies.pop(token, None)

    def _loop(self) -> None:
        connector = ZmqConnector(self._listen)
        for peer in (self.prefill, self.decode):
            connector.connect(peer)
        self._ready.set_result(connector)
        try:
            while not self._stopped.is_set():
                while not self._outbox.empty():
                    connector.send(*self._outbox.get_nowait())
                received = connector.recv(0.005)
                if received is not None:
                    self._dispatch_safely(*received)
        finally:
            connector.close()

    def _dispatch_safely(self, sender: str, message: Message) -> None:
        """A malformed message is logged and dropped: the one I/O thread must outlive it."""
        try:
            self._dispatch(message)
        except Exception:
            log.exception("router: bad %r message from %s", message.kind, sender)

    def _dispatch(self, message: Message) -> None:
        if message.kind in (PEER_DOWN, PEER_UP):
            peer = message.fields["peer"]
            if message.kind == PEER_UP:  # possibly a new process: it stays down until its hello is in
                self._send(peer, "hello", token=REHELLO)
                return
            self._down.add(peer)
            if peer == self.decode:
                self._fail_all_streams("decode_lost")
            return
        token = message.fields.get("token")
        if token == REHELLO:
            self._adopt(message.fields)
            return
        if token is not None:
            future = self._replies.get(token)
            if future is not None:
                future.set_result(message)
            return
        target = self._streams.get(message.fields.get("request_id", ""))
        if target is not None and not target[0].is_closed():
            target[0].call_soon_threadsafe(target[1].put_nowait, message)

    def _adopt(self, hello: dict[str, Any]) -> None:
        """A (re)connected worker's hello: admission uses its pool and window from now on, so a worker
        restarted with a smaller pool can never be sent what only the old one could hold."""
        role = hello["role"]
        if not self._started.is_set():  # start() is still learning the pools; it asks for itself
            return
        self.workers[role] = WorkerInfo.from_hello(hello)
        address = self.prefill if role == "prefill" else self.decode
        problem = self._mismatch()
        if problem is not None:
            log.error("router: %s worker refused after reconnecting: %s", role, problem)
            self._down.add(address)
            return
        self.max_model_len = self._window()
        self._down.discard(address)

    def _fail_all_streams(self, reason: str) -> None:
        """The decode worker is gone: every request it held ends with an error, none hangs."""
        for request_id, (loop, stream) in list(self._streams.items()):
            lost = _aborted(request_id, reason)
            if not loop.is_closed():
                loop.call_soon_threadsafe(stream.put_nowait, lost)


def _aborted(request_id: str, reason: str) -> Message:
    """An `output` message ending the request as ABORTED, made by the router itself."""
    return Message(
        "output",
        {
            "request_id": request_id,
            "token_ids": [],
            "text": "",
            "finished": True,
            "status": Status.ABORTED.value,
            "finish_reason": reason,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        },
    )


def _output(message: Message) -> RequestOutput:
    f = message.fields
    return RequestOutput(
        f["request_id"],
        f["token_ids"],
        f["text"],
        f["finished"],
        Status(f["status"]),
        f["finish_reason"],
        f["prompt_tokens"],
        f["completion_tokens"],
    )
