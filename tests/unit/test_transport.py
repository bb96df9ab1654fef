"""Trust nothing that arrives: the transport, the message parser and the receivers' rules, without a model
server (tiny engines, real ZeroMQ sockets on loopback where the transport itself is under test).

Each test fails if its protection is removed: CURVE and the ZAP allow-list, the sender taken from the
key, link events that no frame can fake, the parser's bounds, the role rules, the answer-only-what-was-
asked rule, and the release of reservations nobody ever wrote into.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from typing import Any

import numpy as np
import pytest
import zmq
from conftest import make_engine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfence.cache.pool import PageState
from kvfence.disagg.connector import MemoryHub, Received, ZmqConnector
from kvfence.disagg.decode import DecodeWorker
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.keys import KeyConfigError, ephemeral, is_loopback, resolve
from kvfence.disagg.launch import free_ports
from kvfence.disagg.messages import (
    KINDS,
    LOGPROB_FLOOR,
    Abort,
    Audit,
    BadMessage,
    Bounds,
    Hello,
    HelloReply,
    Output,
    Page,
    Prefill,
    Reserve,
    StatsReply,
    decode,
    encode,
)
from kvfence.disagg.prefill import PrefillWorker
from kvfence.disagg.questions import Answered, Questions
from kvfence.disagg.router import Router
from kvfence.model.transformer import Transformer
from kvfence.sampling import SamplingParams, TokenLogprobs

BOUNDS = Bounds(max_tokens=48, vocab_size=256)
ROUTER, PREFILL, DECODE = "router", "prefill", "decode"
PARAMS = SamplingParams(max_tokens=2, ignore_eos=True).__dict__


def _recv(connector: ZmqConnector, timeout_s: float) -> Received | None:
    """The next frame within `timeout_s`, skipping this node's own link events."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        item = connector.recv(left)
        if isinstance(item, Received):
            return item
    return None


@pytest.fixture
def keyed() -> Any:
    """A decode and a router connector on loopback with ephemeral keys; closed afterwards."""
    decode_port, router_port = free_ports(2)
    addresses = {DECODE: f"tcp://127.0.0.1:{decode_port}", ROUTER: f"tcp://127.0.0.1:{router_port}"}
    keys = ephemeral([(role, role, address) for role, address in addresses.items()])
    server = ZmqConnector(addresses[DECODE], keys[DECODE])
    client = ZmqConnector(addresses[ROUTER], keys[ROUTER])
    context: zmq.Context[Any] = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)  # the attackers' sockets: nothing of theirs may hold up the exit
    yield server, client, keys, context
    context.destroy(linger=0)
    client.close()
    server.close()


def router_socket(context: zmq.Context[Any], keys: Any, identity: bytes | None = None) -> zmq.Socket[Any]:
    """A raw DEALER holding the router's keys, for the decode server: frames built by hand."""
    socket = context.socket(zmq.DEALER)
    own = keys[ROUTER].identity
    socket.curve_publickey, socket.curve_secretkey = own.public_key.encode(), own.secret_key.encode()
    socket.curve_serverkey = keys[DECODE].identity.public_key.encode()
    if identity is not None:
        socket.setsockopt(zmq.IDENTITY, identity)
    return socket


def test_only_allow_listed_keys_are_heard(keyed: Any) -> None:
    server, client, keys, context = keyed
    plain = context.socket(zmq.DEALER)  # no key at all
    stranger = context.socket(zmq.DEALER)  # CURVE, but a key nobody listed
    public, secret = zmq.curve_keypair()
    stranger.curve_publickey, stranger.curve_secretkey = public, secret
    stranger.curve_serverkey = keys[DECODE].identity.public_key.encode()
    for socket in (plain, stranger):
        socket.connect(server.address)
        socket.send_multipart(encode(Hello(token="x")))
    assert _recv(server, 1.5) is None, "a frame from outside the allow-list was delivered"
    assert server.rejected["unknown_key"] >= 1  # the stranger's handshake, refused and counted
    client.send(server.address, Hello(token="y"))
    heard = _recv(server, 5.0)
    assert heard is not None and (heard.sender, heard.role) == (client.address, ROUTER)


def test_the_sender_is_the_key_never_the_frame(keyed: Any) -> None:
    """A listed peer that names itself as another (its routing identity) is still itself."""
    server, client, keys, context = keyed
    liar = router_socket(context, keys, identity=b"tcp://10.9.9.9:1")  # claims to be someone else
    liar.connect(server.address)
    liar.send_multipart(encode(Hello(token="z")))
    heard = _recv(server, 5.0)
    assert heard is not None and (heard.sender, heard.role) == (client.address, ROUTER)


def test_a_node_dials_only_configured_peers(keyed: Any) -> None:
    _, client, _, _ = keyed
    with pytest.raises(ValueError, match="not a configured peer"):
        client.send("tcp://127.0.0.1:9", Hello(token="q"))


def test_bad_frame_counts_are_dropped_not_raised(keyed: Any) -> None:
    server, _, keys, context = keyed
    raw = router_socket(context, keys)
    raw.connect(server.address)
    raw.send_multipart([b"only one frame"])
    raw.send_multipart([b"{}", b"", b"three"])
    assert _recv(server, 1.5) is None
    assert server.rejected["frame_count"] == 2


# ---- sends never block ------------------------------------------------------------------------------------

HWM = 4


def test_a_send_to_a_stopped_peer_never_blocks() -> None:
    """Nothing listens at the peer's address (its process stopped): the first HWM sends are queued for it,
    every later one returns False at once, dropped whole and counted. (A blocking send stopped the
    sender's only thread at the first message past the mark.)"""
    (port,) = free_ports(1)
    connector = ZmqConnector("tcp://127.0.0.1:0", send_hwm=HWM)
    try:
        sent = [connector.send(f"tcp://127.0.0.1:{port}", Hello(token=f"q{i}")) for i in range(40)]
    finally:
        connector.close()
    assert sent == [True] * HWM + [False] * (40 - HWM)
    assert connector.rejected["send_blocked"] == 40 - HWM


def test_a_peer_that_reads_nothing_meanwhile_gets_only_whole_messages_in_order() -> None:
    """A bound socket that reads nothing while 2000 pages are sent to it: every send returns, the ones
    refused are counted, and what the peer reads afterwards is exactly the pages whose send said True, in
    order, each whole (its header and its 64 KiB payload together)."""
    context: zmq.Context[Any] = zmq.Context()
    peer = context.socket(zmq.ROUTER)
    peer.setsockopt(zmq.RCVHWM, 1)
    peer.bind("tcp://127.0.0.1:0")
    connector = ZmqConnector("tcp://127.0.0.1:0", send_hwm=HWM)
    pages = [Page("r", i, i, 1, i, payload=i.to_bytes(4, "big") * (1 << 14)) for i in range(2000)]
    try:
        sent = [connector.send(peer.getsockopt_string(zmq.LAST_ENDPOINT), page) for page in pages]
        queued = [page for page, ok in zip(pages, sent, strict=True) if ok]
        assert len(queued) < len(pages) and connector.rejected["send_blocked"] == sent.count(False)
        heard = []
        while len(heard) < len(queued) and peer.poll(5000):  # a bound on the wait, not a measurement
            heard.append(peer.recv_multipart())
    finally:
        connector.close()
        context.destroy(linger=0)
    assert [frames[1:] for frames in heard] == [list(encode(page)) for page in queued]


# ---- the parser -----------------------------------------------------------------------------------------


def test_waiting_for_a_frame_sleeps() -> None:
    """An idle worker or router waits on its socket most of its life: that wait must not spin. (A wait cut
    to whole milliseconds by truncation ended in poll(0) loops: a fifth of a core for 5 ms waits.)"""
    connector = ZmqConnector("tcp://127.0.0.1:0")
    try:
        cpu, wall = time.process_time(), time.monotonic()
        for _ in range(60):
            assert connector.recv(0.005) is None
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    finally:
        connector.close()
    assert wall >= 0.3 and cpu < 0.1 * wall, f"{cpu:.3f} s of CPU in {wall:.3f} s of waiting"


def test_wake_ends_a_wait_from_another_thread() -> None:
    """The router's I/O thread waits on its socket while messages for the workers queue up in other
    threads: `wake` hands it the thread at once (it used to poll its queue every 5 ms), and is harmless
    once the connector is closed (its pipe's fd may then belong to someone else)."""
    connector = ZmqConnector("tcp://127.0.0.1:0")
    try:
        threading.Timer(0.05, connector.wake).start()
        # An hour's wait: it returns only because of the wake (else pytest's timeout fails the test).
        assert connector.recv(3600.0) is None
    finally:
        connector.close()
    connector.wake()


def test_link_events_cannot_be_sent() -> None:
    for kind in ("peer_down", "peer_up", "error"):
        with pytest.raises(BadMessage) as err:
            decode(json.dumps({"kind": kind, "peer": "tcp://x"}).encode(), b"", BOUNDS)
        assert err.value.reason == "unknown_kind"


def reserve(**overrides: Any) -> dict[str, Any]:
    fields = {"request_id": "r", "tenant": "A", "prompt": [1], "params": PARAMS, "prefill": "p"}
    return {"kind": "reserve", **fields, **overrides}


PAGE = {
    **{"kind": "page", "request_id": "r"},
    **{"logical": 0, "page": 0, "generation": 0, "slots": 1, "checksum": 0},
}


def output(**overrides: Any) -> dict[str, Any]:
    """A decode -> router output of two tokens with their logprobs (two top entries each)."""
    fields = {"request_id": "r", "token_ids": [5, 6], "text": "ab", "finished": False, "status": "running"}
    fields |= {"finish_reason": None, "prompt_tokens": 3, "completion_tokens": 2, "logprobs": [-0.5, -1.0]}
    fields |= {"top_ids": [[5, 7], [6, 5]], "top_logprobs": [[-0.5, -2.0], [-1.0, -1.5]]}
    return {"kind": "output", **fields, **overrides}


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        (reserve(prompt=[999]), "bad_field"),  # a token id outside the vocabulary
        (reserve(prompt=[1] * 50), "bad_field"),  # longer than the model could ever take
        (reserve(params={"max_tokens": 0}), "bad_field"),
        (reserve(params={"evil": 1}), "bad_field"),
        (reserve(tenant=["A"]), "bad_field"),
        ({"kind": "abort", "request_id": "r" * 300}, "bad_field"),
        ({"kind": "abort", "request_id": "r", "extra": 1}, "bad_field"),
        (PAGE | {"logical": -1}, "bad_field"),
        (PAGE | {"checksum": 1 << 64}, "bad_field"),
        ({"kind": "complete", "request_id": "r", "pages": True, "tokens": 1}, "bad_field"),
        ({"request_id": "r"}, "unknown_kind"),
        (output(top_ids=None), "bad_field"),  # logprobs without their top entries
        (output(logprobs=[-0.5]), "bad_field"),  # not one entry per token
        (output(top_ids=[[5], [6, 5]]), "bad_field"),  # top ids and top logprobs differ in length
        (output(top_ids=[[5, 999], [6, 5]]), "bad_field"),  # a top id outside the vocabulary
        (output(logprobs=[0.5, -1.0]), "bad_field"),  # a probability above 1
        (output(top_logprobs=[[-0.5, "x"], [-1.0, -1.5]]), "bad_field"),
        (reserve(guide={"kind": "json", "spec": "not a schema"}), "bad_field"),  # a spec of another type
        (reserve(guide={"kind": "python", "spec": "import os"}), "bad_field"),  # no such kind
        (reserve(guide={"kind": "regex", "spec": "a+", "extra": 1}), "bad_field"),
        (reserve(n=0), "bad_field"),  # no choice at all
        (reserve(n=1000), "bad_field"),  # more choices than OpenAI allows
        *[  # a refusal that would be a success, or a status the worker chose: never a refusal's
            ({"kind": "rejected", "request_id": "r", "code": "x", "message": "m", "status": s}, "bad_field")
            for s in (200, 500, 302)
        ],
    ],
)
def test_out_of_bounds_fields_are_refused(fields: dict[str, Any], reason: str) -> None:
    with pytest.raises(BadMessage) as err:
        decode(json.dumps(fields).encode(), b"", BOUNDS)
    assert err.value.reason == reason


def test_output_logprobs_round_trip() -> None:
    """What decode sends is what the router rebuilds: each token's logprob and its top entries, -inf as
    the floor (JSON has no infinity)."""
    entries = [TokenLogprobs(5, -0.5, [(5, -0.5), (7, -math.inf)]), TokenLogprobs(6, -1.0, [(6, -1.0)])]
    sent = Output("r", [5, 6], "ab", False, "running", None, 3, 2, **Output.logprobs_fields(entries))
    received = decode(*encode(sent), BOUNDS)
    assert isinstance(received, Output)
    assert received.token_logprobs() == [
        TokenLogprobs(5, -0.5, [(5, -0.5), (7, LOGPROB_FLOOR)]),
        TokenLogprobs(6, -1.0, [(6, -1.0)]),
    ]
    plain = decode(*encode(Output("r", [5], "a", True, "finished", "stop", 3, 1)), BOUNDS)
    assert isinstance(plain, Output) and plain.token_logprobs() is None
    assert isinstance(decode(json.dumps(output()).encode(), b"", BOUNDS), Output)


def test_nesting_past_the_stack_is_a_bad_message(tiny: Transformer) -> None:
    """10 KB of brackets made json.loads raise RecursionError, which ended a worker's loop."""
    header = b'{"kind": "audit", "token": "t", "request_id": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(BadMessage) as err:
        decode(header, b"", BOUNDS)
    assert err.value.reason == "not_json"
    node = Node(tiny)
    node.decode.handle(Received(PREFILL, "prefill", header, b""))
    assert node.decode.rejected == {"not_json": 1}


def test_only_a_page_carries_a_payload() -> None:
    header, _ = encode(Hello(token="t"))
    with pytest.raises(BadMessage):
        decode(header, b"smuggled", BOUNDS)
    page = Page("r", 0, 1, 2, 4, b"kv bytes")
    assert decode(*encode(page), BOUNDS) == page


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
VALUE = JSON
FRAMES = st.one_of(
    st.binary(max_size=200),
    st.builds(
        lambda kind, fields: json.dumps({"kind": kind, **fields}).encode(),
        st.sampled_from([*KINDS, "peer_down", "nonsense"]),
        st.dictionaries(
            st.sampled_from(["request_id", "token", "prompt", "page", "targets", "params"]), JSON
        ),
    ),
)


@settings(max_examples=300, deadline=None)
@given(header=FRAMES, payload=st.binary(max_size=64))
def test_the_parser_raises_nothing_but_bad_message(header: bytes, payload: bytes) -> None:
    with contextlib.suppress(BadMessage):
        decode(header, payload, BOUNDS)


# ---- the receivers ----------------------------------------------------------------------------------------


class Node:
    """A prefill and a decode worker on tiny engines over an in-memory network whose addresses carry
    roles, as keys would prove them."""

    def __init__(self, model: Transformer, transfer_timeout_s: float = 30.0) -> None:
        self.hub = MemoryHub()
        self.router = self.hub.connector(ROUTER, "router")
        prefill, decode = (make_engine(model, HandoffEngine, enable_prefix_caching=False) for _ in range(2))
        self.prefill = PrefillWorker(prefill, self.hub.connector(PREFILL, "prefill"))
        self.decode = DecodeWorker(decode, self.hub.connector(DECODE, "decode"), transfer_timeout_s)

    def deliver(self, worker: PrefillWorker | DecodeWorker) -> None:
        mailbox = self.hub.mailboxes[worker.connector.address]
        while mailbox:
            worker.handle(mailbox.popleft())

    def replies(self) -> list[Any]:
        mailbox = self.hub.mailboxes[ROUTER]
        return [decode(r.header, r.payload, BOUNDS) for r in (mailbox.popleft() for _ in range(len(mailbox)))]

    def state(self) -> tuple[Any, ...]:
        """Everything a refused frame must leave as it was."""
        workers = (self.prefill, self.decode)
        pools = [(w.engine.pool.generation.tolist(), w.engine.pool.state.tolist()) for w in workers]
        requests = [sorted(w.engine.requests) for w in workers]
        return (*pools, *requests, sorted(self.decode.inbound), sorted(self.prefill.transfers))


def frame(sender: str, role: str | None, message: Any) -> Received:
    return Received(sender, role, *encode(message))


def test_role_rules_at_receipt(tiny: Transformer) -> None:
    node = Node(tiny)
    before = node.state()
    prompt = [1, 2, 3, 4, 5, 6, 7]
    # A prefill key asks decode to reserve as tenantA, and for another request's trail.
    node.decode.handle(frame(PREFILL, "prefill", Reserve("r1", "tenantA", prompt, PARAMS, PREFILL)))
    node.decode.handle(frame(PREFILL, "prefill", Audit(token="t", request_id="r1")))
    # A decode key sends prefill work (a prefix-cache probe as tenantA).
    node.prefill.handle(frame(DECODE, "decode", Prefill("r2", "tenantA", prompt, DECODE, [[0, 1], [1, 1]])))
    assert node.state() == before
    assert not node.hub.mailboxes[PREFILL] and not node.hub.mailboxes[DECODE] and node.replies() == []
    assert node.decode.rejected["wrong_role"] == 2 and node.prefill.rejected["wrong_role"] == 1
    # The same reserve from the router is served.
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "tenantA", prompt, PARAMS, PREFILL)))
    assert [r.KIND for r in node.replies()] == ["reserved"]


def test_a_reserve_must_name_a_configured_prefill(tiny: Transformer) -> None:
    node = Node(tiny)
    before = node.state()
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", [1, 2, 3], PARAMS, "tcp://unreachable:1")))
    assert node.state() == before and node.replies() == []
    assert node.decode.rejected["bad_peer"] == 1


def test_a_guide_decode_cannot_compile_is_refused_before_any_page(tiny: Transformer) -> None:
    """A reserve's guide is compiled on decode before anything is reserved: one it cannot enforce (here,
    the tiny model has no tokenizer) is a `rejected` to the router, the pool unchanged."""
    node = Node(tiny)
    before = node.state()
    guided = Reserve("r1", "A", [1, 2, 3], PARAMS, PREFILL, {"kind": "regex", "spec": "[ab]+"})
    node.decode.handle(frame(ROUTER, "router", guided))
    assert node.state() == before
    (reply,) = node.replies()
    assert reply.KIND == "rejected" and "tokenizer" in reply.message


def test_only_the_reserving_router_may_abort(tiny: Transformer) -> None:
    node = Node(tiny)
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", [1, 2, 3, 4, 5], PARAMS, PREFILL)))
    node.replies()
    other = node.hub.connector("router-2", "router")
    node.decode.handle(Received(other.address, "router", *encode(Abort("r1", "x"))))
    assert "r1" in node.decode.engine.requests and node.decode.rejected["not_assigned"] == 1


def test_malformed_frames_change_nothing(tiny: Transformer) -> None:
    node = Node(tiny)
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", [1, 2, 3, 4, 5], PARAMS, PREFILL)))
    node.replies()
    before = node.state()

    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(header=FRAMES, payload=st.binary(max_size=32), role=st.sampled_from([None, "router", "prefill"]))
    def throw(header: bytes, payload: bytes, role: str | None) -> None:
        for worker in (node.prefill, node.decode):
            worker.handle(Received("somewhere", role, header, payload))
        assert node.state() == before

    throw()
    assert sum(node.decode.rejected.values()) > 0


def test_a_reservation_nobody_wrote_into_is_released_on_timeout(tiny: Transformer) -> None:
    node = Node(tiny, transfer_timeout_s=1.0)
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", [1] * 13, PARAMS, PREFILL)))
    (reserved,) = node.replies()
    pages = [p for p, _ in reserved.targets]
    node.decode.tick(time.monotonic() + 5)  # the prefill never sent anything (unreachable, or lying)
    pool = node.decode.engine.pool
    assert (pool.state[pages] == PageState.FREE).all(), "an unwritten reservation pinned the pool"
    kinds = node.decode.engine.events.kinds("r1")
    assert "quarantined" not in kinds and kinds[-2:] == ["aborted", "released"]


def test_a_started_transfer_keeps_the_drain_rule_on_timeout(tiny: Transformer) -> None:
    node = Node(tiny, transfer_timeout_s=1.0)
    prompt = [1] * 13
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", prompt, PARAMS, PREFILL)))
    (reserved,) = node.replies()
    node.prefill.handle(frame(ROUTER, "router", Prefill("r1", "A", prompt, DECODE, reserved.targets)))
    node.replies()
    node.prefill.run_once()  # computes and sends the pages
    mailbox = node.hub.mailboxes[DECODE]
    node.decode.handle(mailbox.popleft())  # one page arrived: the prefill holds the targets
    node.decode.tick(time.monotonic() + 5)
    pages = [p for p, _ in reserved.targets]
    assert (node.decode.engine.pool.state[pages] == PageState.QUARANTINED).all()
    mailbox.clear()  # the rest of the pages are lost; the abort reaches prefill, its ack comes back
    node.deliver(node.prefill)
    node.deliver(node.decode)
    assert (node.decode.engine.pool.state[pages] == PageState.FREE).all()


def test_one_tenant_cannot_hold_the_whole_decode_pool(tiny: Transformer) -> None:
    node = Node(tiny)
    cap = node.decode.max_reserved_pages
    assert cap < node.decode.engine.pool.num_pages
    codes = []
    for i in range(node.decode.engine.pool.num_pages):
        node.decode.handle(frame(ROUTER, "router", Reserve(f"r{i}", "A", [1] * 40, PARAMS, PREFILL)))
        codes += [getattr(r, "code", r.KIND) for r in node.replies()]
    held = sum(len(r.record.pages) for r in node.decode.engine.requests.values())
    assert held <= cap and "server_busy" in codes
    node.decode.handle(frame(ROUTER, "router", Reserve("b", "B", [1] * 40, PARAMS, PREFILL)))
    assert [r.KIND for r in node.replies()] == ["reserved"], "another tenant was starved"


def test_the_router_takes_only_answers_to_its_own_questions(tiny: Transformer) -> None:
    router = Router(PREFILL, DECODE, None, 256)  # type: ignore[arg-type]  # no tokenizer needed here
    forged = HelloReply("re0", "decode", 10**9, 10**9, 16, False, {"isolation": False})
    router._dispatch_safely(frame(DECODE, "decode", forged))
    router._dispatch_safely(frame("tcp://elsewhere", None, forged))
    assert router.workers == {} and router.rejected["unsolicited"] == 2
    for header in (b"\xff\xfe", b"{}", b'{"kind": "peer_down", "peer": "decode"}', b"[1, 2]"):
        router._dispatch_safely(Received(DECODE, "decode", header, b""))
    assert DECODE not in router.placement.down and sum(router.rejected.values()) == 6


def test_a_question_is_answered_once_by_its_worker_with_its_kind() -> None:
    """A reply from another worker, of another kind, or a second one to the same question is unsolicited
    (a replayed answer must not reach the asker twice nor raise in the I/O thread)."""
    questions = Questions()
    token, future = questions.ask(DECODE, StatsReply.KIND)
    hello = HelloReply(token, "decode", 64, 64, 16, True, {})
    stats = StatsReply(token, {})
    assert questions.take(PREFILL, token, stats) is Answered.UNSOLICITED
    assert questions.take(DECODE, token, hello) is Answered.UNSOLICITED and not future.done()
    assert questions.take(DECODE, token, stats) is Answered.AWAITED and future.result() is stats
    assert questions.take(DECODE, token, StatsReply(token, {"x": 1})) is Answered.UNSOLICITED
    assert future.result() is stats
    again = questions.ask_unawaited(DECODE, HelloReply.KIND)
    hello = HelloReply(again, "decode", 64, 64, 16, True, {})
    assert questions.take(DECODE, again, hello) is Answered.UNAWAITED
    assert questions.take(DECODE, again, hello) is Answered.UNSOLICITED  # closed by the first
    questions.close(token)
    assert questions.take(DECODE, token, stats) is Answered.UNSOLICITED


# ---- start-up ---------------------------------------------------------------------------------------------


def test_non_loopback_without_keys_is_refused() -> None:
    assert (
        is_loopback("tcp://127.0.0.1:5600")
        and is_loopback("tcp://localhost:1")
        and is_loopback("tcp://[::1]:1")
    )
    assert not is_loopback("tcp://10.0.0.1:5600") and not is_loopback("tcp://0.0.0.0:5600")
    with pytest.raises(KeyConfigError, match="--keys"):
        resolve(None, "prefill", ["tcp://10.0.0.1:5600"], insecure=False)
    assert resolve(None, "prefill", ["tcp://10.0.0.1:5600"], insecure=True) is None
    assert resolve(None, "prefill", ["tcp://127.0.0.1:5600"], insecure=False) is None


def test_page_payload_bounds_are_the_receivers_page(tiny: Transformer) -> None:
    """A payload of the wrong size is refused before anything is written (the checksum covers the rest)."""
    node = Node(tiny)
    node.decode.handle(frame(ROUTER, "router", Reserve("r1", "A", [1] * 13, PARAMS, PREFILL)))
    (reserved,) = node.replies()
    page, generation = reserved.targets[0]
    written = node.decode.engine.pool.written.copy()
    node.decode.handle(frame(PREFILL, "prefill", Page("r1", 0, page, generation, 0, b"short")))
    assert np.array_equal(node.decode.engine.pool.written, written)
    trail = node.decode.engine.events.for_request("r1")
    assert [e["kind"] for e in trail[-2:]] == ["aborted", "quarantined"]
    assert trail[-2]["reason"] == "checksum_mismatch"
