"""The prefill -> decode handoff, in process, with exact message interleavings (MemoryConnector).

The test plays the router. Every transfer fault runs twice: isolation off shows the leak (decode reads a
page holding another request's data, or its output changes) and isolation on aborts exactly the affected
request with its reason, while the victim request that follows produces its solo tokens.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
import xxhash
from conftest import make_engine

from kvfence.cache.pool import KVPool, PageState
from kvfence.disagg.connector import LinkEvent, MemoryConnector, MemoryHub, Received
from kvfence.disagg.decode import QUARANTINE_S, DecodeWorker
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.messages import (
    Abort,
    AbortAck,
    Bounds,
    Msg,
    Output,
    Page,
    Prefill,
    Reserve,
    decode,
    encode,
)
from kvfence.disagg.nixl_transport import OneSidedAgent
from kvfence.disagg.prefill import PrefillWorker
from kvfence.engine.stats import EngineStats
from kvfence.engine.trace import PageTrace
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams
from kvfence.trail.reasons import CHECKSUM_MISMATCH, INCOMPLETE_HANDOFF

_rng = random.Random(11)
PROMPTS = {n: [_rng.randrange(256) for _ in range(n)] for n in (1, 6, 13, 22, 30, 40)}
ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
BOUNDS = Bounds(max_tokens=48, vocab_size=256)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    status: str = ""
    reason: str | None = None


class Pipeline:
    """A prefill and a decode worker on tiny engines, joined by an in-memory network."""

    def __init__(
        self,
        model: Transformer,
        isolation: bool = True,
        prefill_pages: int = 64,
        decode_pages: int = 64,
        agent: Callable[[str, HandoffEngine], OneSidedAgent] | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.hub = MemoryHub()
        # Each address has the role a key would prove (the ROLE_RULES are enforced on every delivery).
        self.router = self.hub.connector(ROUTER, "router")
        settings = {"isolation": isolation, "enable_prefix_caching": False, "kv_cache_dtype": kv_cache_dtype}
        # Each worker's window is what its own pool can hold (a prefill pool may be smaller than decode's).
        engines = {
            role: make_engine(model, HandoffEngine, num_pages=n, max_model_len=min(48, n * 4), **settings)
            for role, n in (("prefill", prefill_pages), ("decode", decode_pages))
        }
        agents = {role: agent(role, engine) if agent else None for role, engine in engines.items()}
        self.prefill = PrefillWorker(
            engines["prefill"], self.hub.connector(PREFILL, "prefill"), agents["prefill"]
        )
        self.decode = DecodeWorker(
            engines["decode"], self.hub.connector(DECODE, "decode"), agent=agents["decode"]
        )
        self.trace = PageTrace(self.decode.engine.pool)
        self.decode.engine.runner.observer = self.trace
        self.results: dict[str, Result] = {}
        self.replies: list[Msg] = []

    def reserve(self, request_id: str, tenant: str, prompt: list[int], max_tokens: int = 6) -> Msg:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True).__dict__
        self.router.send(DECODE, Reserve(request_id, tenant, prompt, params, PREFILL))
        self.deliver(DECODE)
        return self.reply(request_id)

    def start_prefill(self, request_id: str, tenant: str, prompt: list[int], targets: list[list[int]]) -> Msg:
        self.router.send(PREFILL, Prefill(request_id, tenant, prompt, DECODE, targets))
        self.deliver(PREFILL)
        return self.reply(request_id)

    def submit(self, request_id: str, tenant: str, prompt: list[int], max_tokens: int = 6) -> None:
        reserved = self.reserve(request_id, tenant, prompt, max_tokens)
        assert reserved.KIND == "reserved", reserved
        if len(prompt) > 1:
            assert self.start_prefill(request_id, tenant, prompt, targets(reserved)).KIND == "accepted"

    def abort(self, request_id: str) -> None:
        self.router.send(DECODE, Abort(request_id=request_id, reason="router_gave_up"))

    def deliver(self, address: str, count: int | None = None) -> None:
        """Hand the next `count` (default: all) waiting messages of `address` to its worker."""
        worker = self.prefill if address == PREFILL else self.decode
        mailbox = self.hub.mailboxes[address]
        for _ in range(len(mailbox) if count is None else count):
            worker.handle(mailbox.popleft())  # parsed and role-checked as off the wire

    def run(self) -> None:
        """Until quiet: messages delivered, engines stepped, outputs collected."""
        while (
            self.hub.mailboxes[PREFILL]
            or self.hub.mailboxes[DECODE]
            or self.prefill.engine.has_unfinished()
            or self.decode.engine.has_unfinished()
            or self.hub.mailboxes[ROUTER]
        ):
            self.prefill.run_once()
            self.decode.run_once()
            self._collect()

    def reply(self, request_id: str) -> Msg:
        self._collect()
        for i, message in enumerate(self.replies):
            if getattr(message, "request_id", None) == request_id:
                return self.replies.pop(i)
        raise AssertionError(f"no reply for {request_id}")

    def _collect(self) -> None:
        while (received := self.router.recv(0)) is not None:
            assert isinstance(received, Received)
            message = decode(received.header, received.payload, BOUNDS)
            if not isinstance(message, Output):
                self.replies.append(message)
                continue
            result = self.results.setdefault(message.request_id, Result())
            result.tokens += message.token_ids
            result.status, result.reason = message.status, message.finish_reason


def targets(reserved: Msg) -> list[list[int]]:
    return getattr(reserved, "targets")  # noqa: B009 - a Reserved


def request_of(received: Received | LinkEvent) -> str | None:
    """The request id a frame in a mailbox names."""
    if isinstance(received, LinkEvent):
        return None
    return getattr(decode(received.header, received.payload, BOUNDS), "request_id", None)


def lifecycle(pipe: Pipeline, request_id: str) -> list[str]:
    """Decode's events for the request without the per-page ones (received or refused)."""
    return [
        k for k in pipe.decode.engine.events.kinds(request_id) if k not in ("page_received", "write_refused")
    ]


def solo(
    model: Transformer, prompt: list[int], max_tokens: int = 6, kv_cache_dtype: str = "auto"
) -> list[int]:
    engine = make_engine(model, max_model_len=48, kv_cache_dtype=kv_cache_dtype)
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[
        0
    ].output_token_ids


def assert_tokens_equal_single_node(pipe: Pipeline, model: Transformer) -> None:
    """Prompts of 1 to 30 tokens through the pipe (either transport): each answer equals the single-node
    one, nobody reads a foreign page, every page is free after, and decode's trail is in order."""
    lengths, kv_cache_dtype = [1, 6, 13, 22, 30], pipe.decode.engine.config.kv_cache_dtype
    for i, n in enumerate(lengths):
        pipe.submit(f"r{i}", "t", PROMPTS[n])
    pipe.run()
    for i, n in enumerate(lengths):
        expected = solo(model, PROMPTS[n], kv_cache_dtype=kv_cache_dtype)
        assert pipe.results[f"r{i}"] == Result(expected, "finished", "length")
        assert pipe.trace.foreign_reads(f"r{i}") == []
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages
    assert pipe.prefill.engine.allocator.num_free_pages == pipe.prefill.engine.pool.num_pages
    assert pipe.decode.engine.pool.refused_writes == 0
    kinds = pipe.decode.engine.events.kinds("r3")
    assert (
        kinds.index("pages_allocated")
        < kinds.index("page_received")
        < kinds.index("transfer_complete")
        < kinds.index("step")
        < kinds.index("finished")
    )


def test_disaggregated_tokens_equal_single_node(tiny: Transformer) -> None:
    pipe = Pipeline(tiny)
    assert_tokens_equal_single_node(pipe, tiny)
    started = [e for e in pipe.prefill.engine.events.for_request("r3") if e["kind"] == "transfer_started"]
    assert started[0]["transport"] == "zmq"


def test_disaggregated_tokens_over_float16_pools_equal_single_node(tiny: Transformer) -> None:
    """Pages move as bytes: float16 pools on both workers give the single node's float16 tokens."""
    pipe = Pipeline(tiny, kv_cache_dtype="float16")
    assert pipe.prefill.engine.pool.kv.dtype == pipe.decode.engine.pool.kv.dtype == torch.float16
    assert_tokens_equal_single_node(pipe, tiny)


def fill_decode_pool_with_a_secret(pipe: Pipeline) -> None:
    """Tenant A's request runs to completion: its pages go back to the pool still holding A's KV."""
    pipe.submit("a", "A", PROMPTS[22], max_tokens=4)
    pipe.run()
    assert pipe.results["a"].status == "finished"


# ---- faults where the sender lies about completeness or content ------------------------------------------


@dataclass(frozen=True)
class SenderFault:
    name: str
    reason: str  # decode's abort reason with isolation on
    prefill_pages: int = 64


SENDER_FAULTS = {
    f.name: f
    for f in (
        # The incident: prefill's pool cannot hold B's prompt; it swaps in a one-token placeholder.
        SenderFault("placeholder_transfer", INCOMPLETE_HANDOFF, prefill_pages=8),
        SenderFault("partial_transfer", INCOMPLETE_HANDOFF),
        SenderFault("transfer_failure_ack_mismatch", INCOMPLETE_HANDOFF),
        SenderFault("corrupt_page", CHECKSUM_MISMATCH),
    )
}


def run_sender_fault(model: Transformer, fault: SenderFault, isolation: bool) -> Pipeline:
    pipe = Pipeline(model, isolation, prefill_pages=fault.prefill_pages, decode_pages=12)
    fill_decode_pool_with_a_secret(pipe)
    pipe.prefill.engine.faults.arm(fault.name, times=1)
    pipe.submit("b", "B", PROMPTS[40])  # 40 tokens: more than an 8-page prefill pool holds
    pipe.run()
    assert pipe.prefill.engine.faults.fired == {fault.name: 1}
    return pipe


@pytest.mark.parametrize("name", sorted(SENDER_FAULTS))
def test_sender_fault_leaks_with_isolation_off(tiny: Transformer, name: str) -> None:
    pipe = run_sender_fault(tiny, SENDER_FAULTS[name], isolation=False)
    b = pipe.results["b"]
    assert b.status == "finished", "without the fence decode answers as if nothing happened"
    assert b.tokens != solo(tiny, PROMPTS[40])
    if name != "corrupt_page":  # the others read pages never written for B, some holding tenant A's KV
        tenant_a = pipe.decode.engine.allocator.tenant_id("A")
        assert tenant_a in {access.last_writer for access in pipe.trace.foreign_reads("b")}


@pytest.mark.parametrize("name", sorted(SENDER_FAULTS))
def test_sender_fault_is_caught_with_isolation_on(tiny: Transformer, name: str) -> None:
    fault = SENDER_FAULTS[name]
    pipe = run_sender_fault(tiny, fault, isolation=True)
    assert pipe.results["b"] == Result([], "aborted", fault.reason)
    assert EngineStats.read(pipe.decode.engine).integrity_aborts[fault.reason] == 1  # as /metrics shows it
    assert "step" not in pipe.decode.engine.events.kinds("b"), "decode ran a step on an incomplete handoff"
    assert pipe.trace.reads.get("b") is None
    pipe.run()  # the quarantine drains on prefill's abort-ack
    assert lifecycle(pipe, "b")[-4:] == ["aborted", "quarantined", "drained", "released"]
    pipe.submit("c", "C", PROMPTS[13])
    pipe.run()
    assert pipe.results["c"] == Result(solo(tiny, PROMPTS[13]), "finished", "length")
    pipe.decode.engine.check_integrity()
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages


# ---- faults where a write arrives after the pages were given up -----------------------------------------


def abort_then_late_page(pipe: Pipeline, fault: str) -> None:
    """R1 is aborted while its pages may still be on the way; they arrive after R2 got R1's pages. R1's
    prompt is R2's reversed: its KV differs wherever it lands (only written slots travel)."""
    other = PROMPTS[22][::-1]
    reserved = pipe.reserve("r1", "A", other, max_tokens=2)
    pipe.start_prefill("r1", "A", other, targets(reserved))
    if fault == "abort_mid_transfer":
        pipe.prefill.run_once()  # r1's pages are sent: in flight when the router gives up
        pipe.abort("r1")
        pipe.hub.mailboxes[DECODE].rotate(1)  # the router's abort overtakes the pages in flight
        pipe.deliver(DECODE, 1)
        pipe.deliver(PREFILL)  # prefill acks (r1 is already fully sent)
    else:  # late_write_after_cancel: prefill acks the abort but keeps working on r1
        pipe.prefill.engine.faults.arm(fault, times=1)
        pipe.abort("r1")
        pipe.deliver(DECODE)
        pipe.deliver(PREFILL)
    ack = encode(AbortAck(request_id="r1"))[0]
    late = [m for m in pipe.hub.mailboxes[DECODE] if request_of(m) == "r1" and m.header != ack]
    for message in late:
        pipe.hub.mailboxes[DECODE].remove(message)  # held up in the network
    pipe.deliver(DECODE)  # the ack: with isolation on, the quarantine drains only now
    pipe.submit("r2", "B", PROMPTS[22], max_tokens=2)
    pipe.prefill.run_once()  # r2's pages go out (and, with the bug, r1's pages again)
    late += [m for m in pipe.hub.mailboxes[DECODE] if request_of(m) == "r1"]
    for message in late:
        if message in pipe.hub.mailboxes[DECODE]:
            pipe.hub.mailboxes[DECODE].remove(message)
    pipe.hub.mailboxes[DECODE].extend(late)  # r1's pages land after r2's, in pages r2 now owns
    pipe.run()


@pytest.mark.parametrize("fault", ["late_write_after_cancel", "abort_mid_transfer"])
def test_late_write_corrupts_the_next_owner_with_isolation_off(tiny: Transformer, fault: str) -> None:
    pipe = Pipeline(tiny, isolation=False, decode_pages=6)  # r1 and r2 need every page: r2 reuses r1's
    abort_then_late_page(pipe, fault)
    assert pipe.results["r2"].status == "finished"
    assert pipe.decode.engine.pool.refused_writes == 0
    kinds = pipe.decode.engine.events.kinds("r1")
    assert "quarantined" not in kinds and kinds.index("released") < len(kinds)  # released before any drain
    # The late page landed in a page r2 owns; r2 decodes over it (page trace: r2 reads data r1's tenant wrote
    # after r2's own write) and its output differs from the solo run.
    assert pipe.results["r2"].tokens != solo(tiny, PROMPTS[22], max_tokens=2)


@pytest.mark.parametrize("fault", ["late_write_after_cancel", "abort_mid_transfer"])
def test_late_write_is_refused_with_isolation_on(tiny: Transformer, fault: str) -> None:
    pipe = Pipeline(tiny, isolation=True, decode_pages=6)
    abort_then_late_page(pipe, fault)
    assert lifecycle(pipe, "r1")[-4:] == ["aborted", "quarantined", "drained", "released"]
    assert (
        "write_refused" in pipe.decode.engine.events.kinds("r1")
        and pipe.decode.engine.pool.refused_writes >= 1
    )
    first_r2_allocation = min(
        e["seq"] for e in pipe.decode.engine.events.for_request("r2") if e["kind"] == "pages_allocated"
    )
    drained = next(e["seq"] for e in pipe.decode.engine.events.for_request("r1") if e["kind"] == "drained")
    assert drained < first_r2_allocation, "a quarantined page was reused before its transfer drained"
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[22], max_tokens=2), "finished", "length")


def test_quarantined_pages_are_never_reused_before_the_drain(tiny: Transformer) -> None:
    pipe = Pipeline(tiny, isolation=True, decode_pages=6)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pages = [p for p, _ in targets(reserved)]
    pipe.abort("r1")
    pipe.deliver(DECODE)  # abort handled; the ack is not back yet
    pool = pipe.decode.engine.pool
    assert (pool.state[pages] == PageState.QUARANTINED).all()
    assert getattr(pipe.reserve("r2", "B", PROMPTS[22], max_tokens=2), "code") == "server_busy"  # noqa: B009
    pipe.deliver(PREFILL)
    pipe.deliver(DECODE)  # the ack: now the pages drain
    assert (pool.state[pages] == PageState.FREE).all()
    assert pipe.reserve("r3", "B", PROMPTS[22], max_tokens=2).KIND == "reserved"


def test_prefill_worker_loss_drains_its_quarantine(tiny: Transformer) -> None:
    """worker_crash_mid_transfer at the protocol level: the connection to prefill drops mid-transfer."""
    pipe = Pipeline(tiny, isolation=True, decode_pages=6)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pipe.start_prefill("r1", "A", PROMPTS[30], targets(reserved))
    pipe.prefill.run_once()
    pipe.deliver(DECODE, 2)  # two pages arrived, then the worker died
    pipe.hub.mailboxes[DECODE].clear()
    pipe.hub.mailboxes[DECODE].append(LinkEvent(PREFILL, up=False))  # decode's own monitor saw it
    pipe.deliver(DECODE)
    pipe.run()
    assert pipe.results["r1"] == Result([], "aborted", "prefill_lost")
    assert lifecycle(pipe, "r1")[-4:] == ["aborted", "quarantined", "drained", "released"]
    assert pipe.decode.engine.events.for_request("r1")[-2]["how"] == "peer_down"
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages


def test_prefill_rejection_reaches_the_router(tiny: Transformer) -> None:
    pipe = Pipeline(tiny, prefill_pages=4)
    reserved = pipe.reserve("big", "A", PROMPTS[30])
    rejected = pipe.start_prefill("big", "A", PROMPTS[30], targets(reserved))
    assert rejected.KIND == "rejected" and getattr(rejected, "code") == "context_length_exceeded"  # noqa: B009
    assert pipe.prefill.engine.events.kinds("big") == ["rejected"]
    assert pipe.prefill.engine.pool.generation.sum() == 0, "prefill allocated a page for a rejected prompt"


def test_only_the_sending_prefill_can_drain_a_quarantine(tiny: Transformer) -> None:
    pipe = Pipeline(tiny, isolation=True, decode_pages=6)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pages = [p for p, _ in targets(reserved)]
    pipe.abort("r1")
    pipe.deliver(DECODE)
    # Another process holding a prefill key, but not the one this transfer was assigned to.
    header, payload = encode(AbortAck(request_id="r1"))
    pipe.hub.mailboxes[DECODE].append(Received("intruder", "prefill", header, payload))
    pipe.deliver(DECODE)
    assert (pipe.decode.engine.pool.state[pages] == PageState.QUARANTINED).all(), "a stranger drained it"
    pipe.deliver(PREFILL)
    pipe.deliver(DECODE)
    assert (pipe.decode.engine.pool.state[pages] == PageState.FREE).all()


def workers_state(pipe: Pipeline, request_id: str) -> tuple[object, ...]:
    """What a refused replay must leave as it was: each worker's request (the same object, its pages) and
    its transfer state, by identity."""
    live = [w.engine.requests.get(request_id) for w in (pipe.prefill, pipe.decode)]
    return (
        *live,
        *(list(r.record.pages) for r in live if r is not None),
        pipe.decode.inbound.get(request_id),
        pipe.decode.routers.get(request_id),
        pipe.prefill.transfers.get(request_id),
    )


def test_a_reserve_or_prefill_under_a_live_id_is_rejected_and_the_live_request_finishes(
    tiny: Transformer,
) -> None:
    """A replayed (or second router's) `reserve` and `prefill` carrying the id of a request both workers
    hold: each is answered `rejected` (the engine refuses the id; the worker's `except AdmissionError`
    replies), and the live request finishes with its solo tokens. They used to reach the engine's assert,
    and the worker's handler then failed the live request."""
    pipe = Pipeline(tiny)
    pipe.submit("r1", "A", PROMPTS[13])
    before = workers_state(pipe, "r1")
    reserved = pipe.reserve("r1", "B", PROMPTS[6])
    prefilled = pipe.start_prefill("r1", "B", PROMPTS[6], [[0, 1], [1, 1]])
    for reply in (reserved, prefilled):
        assert reply.KIND == "rejected" and getattr(reply, "code") == "duplicate_request_id"  # noqa: B009
        assert getattr(reply, "status") == 409  # noqa: B009 - as the single node answers it
    assert workers_state(pipe, "r1") == before and all(x is not None for x in before)
    pipe.run()
    assert pipe.results["r1"] == Result(solo(tiny, PROMPTS[13]), "finished", "length")
    for worker in (pipe.prefill, pipe.decode):
        assert worker.engine.events.kinds("r1").count("admitted") == 1
        assert worker.engine.allocator.num_free_pages == worker.engine.pool.num_pages


def test_a_quarantined_id_is_not_reserved_again_before_its_drain(tiny: Transformer) -> None:
    """An aborted request's pages wait under its id for the drain: a reserve reusing the id meanwhile is
    rejected (it would have taken over the transfer state the drain waits on), and is served after it."""
    pipe = Pipeline(tiny, isolation=True)
    reserved = pipe.reserve("r1", "A", PROMPTS[22], max_tokens=2)
    pages = [p for p, _ in targets(reserved)]
    pipe.abort("r1")
    pipe.deliver(DECODE)  # quarantined; prefill's ack not back yet
    assert getattr(pipe.reserve("r1", "B", PROMPTS[6]), "code") == "duplicate_request_id"  # noqa: B009
    assert (pipe.decode.engine.pool.state[pages] == PageState.QUARANTINED).all()
    pipe.deliver(PREFILL)
    pipe.deliver(DECODE)  # the ack: drained
    assert (pipe.decode.engine.pool.state[pages] == PageState.FREE).all()
    assert pipe.reserve("r1", "B", PROMPTS[6]).KIND == "reserved"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_page_bytes_round_trip(dtype: torch.dtype) -> None:
    pool = KVPool(2, 4, 4, 2, 8, dtype, "cpu")
    pool.kv.normal_()
    payload = pool.page_bytes(1)
    assert len(payload) == pool.kv[:, :, 1].numel() * pool.kv.element_size()
    pool.load_page_bytes(3, payload)
    assert torch.equal(pool.kv[:, :, 3], pool.kv[:, :, 1])
    # The one-sided handoff's in-place checksum is the checksum of these bytes, and sees any change.
    assert pool.page_checksum(1) == pool.page_checksum(3) == xxhash.xxh3_64_intdigest(payload)
    pool.kv[-1, 1, 3, -1, -1, -1] += 1
    assert pool.page_checksum(3) != pool.page_checksum(1)


def test_a_page_carries_only_its_written_slots(tiny: Transformer) -> None:
    """The prefill pool's pages are recycled and hold an earlier request's KV past what this prompt fills:
    each page frame carries exactly the slots the prompt fills, as decode derives them, never the tail."""
    pipe = Pipeline(tiny)
    pool = pipe.prefill.engine.pool
    pool.kv.fill_(123.0)  # what earlier owners left in every page
    pipe.submit("r1", "A", PROMPTS[22], max_tokens=2)
    pipe.prefill.run_once()
    pages = [m for m in pipe.hub.mailboxes[DECODE] if decode(m.header, m.payload, BOUNDS).KIND == "page"]
    sizes = [len(m.payload) // pool.token_bytes for m in pages]
    full, rest = divmod(21, pool.page_size)  # 21 prompt tokens travel (the last one is decode's to compute)
    assert rest and sizes == [pool.page_size] * full + [rest]
    tail = np.frombuffer(pages[-1].payload, dtype=np.float32)
    assert not (tail == 123.0).any(), "a slot nobody wrote this generation crossed the process"
    pipe.run()
    assert pipe.results["r1"] == Result(solo(tiny, PROMPTS[22], max_tokens=2), "finished", "length")


def rogue_pins(pipe: Pipeline, rogue: MemoryConnector, request_ids: list[str]) -> list[int]:
    """A prefill with a valid key takes each request, sends one page that does not match its checksum
    (decode aborts it and quarantines its pages) and never acknowledges the abort. The pages it pins."""
    pinned = []
    for request_id in request_ids:
        params = SamplingParams(max_tokens=2, ignore_eos=True).__dict__
        pipe.router.send(DECODE, Reserve(request_id, f"tenant-{request_id}", PROMPTS[22], params, "rogue"))
        pipe.deliver(DECODE)
        (page, generation), *_ = entries = targets(pipe.reply(request_id))
        slots = pipe.decode.engine.page_slots(21, 0)
        payload = bytes(slots * pipe.decode.engine.pool.token_bytes)
        rogue.send(DECODE, Page(request_id, 0, page, generation, xxhash.xxh3_64_intdigest(b"x"), payload))
        pipe.deliver(DECODE)
        pinned += [p for p, _ in entries]
    return pinned


def test_a_prefill_that_never_acknowledges_cannot_hold_decodes_pool(tiny: Transformer) -> None:
    """Its quarantines pin decode's pages (another tenant is refused: no free pages) until the quarantine
    deadline: then they are drained under the reason `quarantine_expired`, the rogue is counted and fenced
    off (a reserve naming it answers 503), and the other tenant, through the honest prefill, gets its solo
    tokens. Before the deadline nothing is released: the abort-ack rule still holds."""
    pipe = Pipeline(tiny, decode_pages=14)
    rogue = pipe.hub.connector("rogue", "prefill")
    pinned = rogue_pins(pipe, rogue, ["r1", "r2"])
    pool = pipe.decode.engine.pool
    assert (pool.state[pinned] == PageState.QUARANTINED).all() and len(pipe.hub.mailboxes["rogue"]) == 2
    assert pipe.reserve("b0", "tenant-b", PROMPTS[22]).code == "server_busy"  # type: ignore[attr-defined]
    pipe.decode.tick(time.monotonic())  # not yet due
    assert (pool.state[pinned] == PageState.QUARANTINED).all()
    pipe.decode.tick(time.monotonic() + QUARANTINE_S + 1)
    assert (pool.state[pinned] == PageState.FREE).all()
    for request_id in ("r1", "r2"):
        assert lifecycle(pipe, request_id)[-4:] == ["aborted", "quarantined", "drained", "released"]
        assert pipe.decode.engine.events.for_request(request_id)[-2]["how"] == "quarantine_expired"
    assert pipe.decode.expired["rogue"] == 1 and pipe.decode.rejected["quarantine_expired"] == 1
    params = SamplingParams(max_tokens=2).__dict__
    pipe.router.send(DECODE, Reserve("r3", "tenant-a", PROMPTS[6], params, "rogue"))
    pipe.deliver(DECODE)
    assert pipe.reply("r3").code == "prefill_unavailable"  # type: ignore[attr-defined]
    pipe.submit("b1", "tenant-b", PROMPTS[22])
    pipe.run()
    assert pipe.results["b1"] == Result(solo(tiny, PROMPTS[22]), "finished", "length")


def dropping(connector: MemoryConnector, drop: Callable[[Msg], bool]) -> list[Msg]:
    """Make `connector` drop the messages `drop` picks, as a ZmqConnector does when its peer takes no
    frames (send returns False); returns what it dropped."""
    dropped: list[Msg] = []
    send = connector.send

    def maybe(peer: str, message: Msg) -> bool:
        if drop(message):
            dropped.append(message)
            return False
        return send(peer, message)

    connector.send = maybe  # type: ignore[method-assign]
    return dropped


def test_a_page_the_connector_drops_fails_its_request_at_once(tiny: Transformer) -> None:
    """Prefill's second page of r1 cannot be queued: no later page of it is read or sent, prefill aborts
    it (send_blocked) and frees its pages, decode is told the transfer failed and answers the router an
    abort at once (no waiting for the transfer deadline); r2 after it gets its solo tokens."""
    pipe = Pipeline(tiny)
    dropped = dropping(
        pipe.prefill.connector,
        lambda m: isinstance(m, Page) and m.request_id == "r1" and m.logical == 1,  # type: ignore[arg-type]
    )
    pipe.submit("r1", "A", PROMPTS[22])
    pipe.run()
    assert [m.logical for m in dropped] == [1]  # type: ignore[attr-defined]
    kinds = pipe.prefill.engine.events.kinds("r1")
    assert "transfer_complete" not in kinds and kinds[-2:] == ["aborted", "released"]
    assert pipe.prefill.engine.events.for_request("r1")[-2]["reason"] == "send_blocked"
    assert pipe.results["r1"].status == "aborted" and pipe.results["r1"].reason == "send_blocked"
    assert pipe.decode.engine.events.kinds("r1").count("page_received") == 1
    for worker in (pipe.prefill, pipe.decode):
        assert worker.engine.allocator.num_free_pages == worker.engine.pool.num_pages
    pipe.submit("r2", "B", PROMPTS[13])
    pipe.run()
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[13]), "finished", "length")


def test_an_output_the_connector_drops_ends_its_request_on_decode(tiny: Transformer) -> None:
    """The router's link is full: decode aborts the request whose output it could not queue (its pages
    released now, not when the router's timeout asks), once, though the abort's own output is dropped
    too; another request's outputs go on."""
    pipe = Pipeline(tiny)
    dropped = dropping(pipe.decode.connector, lambda m: isinstance(m, Output) and m.request_id == "r1")
    pipe.submit("r1", "A", PROMPTS[13])
    pipe.submit("r2", "B", PROMPTS[6])
    pipe.run()
    assert [m.status for m in dropped] == ["running", "aborted"]  # type: ignore[attr-defined]
    assert pipe.decode.engine.events.kinds("r1")[-2:] == ["aborted", "released"]
    assert pipe.decode.engine.events.for_request("r1")[-2]["reason"] == "send_blocked"
    assert pipe.results["r2"] == Result(solo(tiny, PROMPTS[6]), "finished", "length")
    assert pipe.decode.engine.allocator.num_free_pages == pipe.decode.engine.pool.num_pages
