"""A worker's replies are untrusted input (disagg/replies.py): what a lying worker says in its hello, its
stats and its audit trail reaches /metrics, /v1/audit and placement only typed and bounded, never as a 500,
and every item dropped or capped is counted as `bad_reply` in kvfence_transport_rejected_total.

The workers are stand-ins on loopback ZeroMQ without keys (the sender is then the routing identity, as
for a real worker there): each answers the router's questions with what the test makes it say, and the
router serves the real HTTP app. Each test fails without its protection.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from kvfence.api.server import build_app
from kvfence.disagg import replies
from kvfence.disagg.connector import LinkEvent, Received, ZmqConnector
from kvfence.disagg.messages import (
    Abort,
    Audit,
    AuditReply,
    Bounds,
    Hello,
    HelloReply,
    Msg,
    Output,
    Reserve,
    Reserved,
    Stats,
    StatsReply,
    decode,
)
from kvfence.disagg.placement import Placement, WorkerInfo
from kvfence.disagg.router import Router
from kvfence.engine.engine import DUPLICATE_REQUEST_ID, AdmissionError
from kvfence.engine.stats import EngineStats
from kvfence.sampling import SamplingParams

ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
BOUNDS = Bounds(max_tokens=1 << 20, vocab_size=256)
HONEST_STATS = EngineStats(64, 60, {"free": 60, "owned": 4, "quarantined": 0}, 0, {}, 0, 0, 0.0).to_dict()
WAIT_S = 10.0


def honest_hello(role: str, **lie: Any) -> dict[str, Any]:
    """An honest hello's fields (a 64-page pool of 4-token pages, a 128-token window), with `lie` on top."""
    info = {"page_size": 4, "isolation": True, "transport": {"kind": "zeromq", "authenticated": False}}
    fields = {"capacity_tokens": 256, "max_model_len": 128, "page_size": 4, "isolation": True, "info": info}
    return {"role": role, **fields, **lie}


class StandIn:
    """The part of a worker the router questions (hello, stats, audit), answering what it is told to."""

    def __init__(
        self,
        role: str,
        address: str = "tcp://127.0.0.1:0",
        hello: dict[str, Any] | None = None,  # what its hello says unlike an honest one
        stats: dict[str, Any] = HONEST_STATS,
    ) -> None:
        self.hello = honest_hello(role, **(hello or {}))
        self.stats = stats
        self.events: list[dict[str, Any]] = []  # its answer to every audit question
        self.hellos = 0  # hellos answered
        self.connector = ZmqConnector(address)  # bound here, used only by the stand-in's thread from now
        self.address = self.connector.address
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stopped.is_set():
                item = self.connector.recv(0.05)
                if isinstance(item, Received):
                    self.connector.send(item.sender, self._answer(decode(item.header, item.payload, BOUNDS)))
        finally:
            self.connector.close()

    def _answer(self, question: Msg) -> Msg:
        if isinstance(question, Hello):
            self.hellos += 1
            return HelloReply(token=question.token, **self.hello)
        if isinstance(question, Stats):
            return StatsReply(question.token, self.stats)
        assert isinstance(question, Audit), question
        return AuditReply(question.token, question.request_id, self.events)

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=WAIT_S)


@contextlib.contextmanager
def serving(
    prefill: list[StandIn], decode_: list[StandIn], **options: Any
) -> Iterator[tuple[Router, TestClient]]:
    """The router (given `options`) in front of the stand-ins, behind the real HTTP app (auth off, an
    admin key)."""
    addresses = [w.address for w in prefill], [w.address for w in decode_]
    router = Router(*addresses, None, 256, **options)  # type: ignore[arg-type]  # no tokenizer needed here
    try:
        with TestClient(build_app(router, "m", None, ADMIN_KEY)) as client:
            yield router, client
    finally:
        router.shutdown()  # also when its start refused (the app then never shuts it down)
        for worker in prefill + decode_:
            worker.stop()


def rebound(address: str, hello: dict[str, Any]) -> StandIn:
    """A decode stand-in on the address a stopped one held, once its socket has let go of the port."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return StandIn("decode", address, hello)
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


# ---- stats -----------------------------------------------------------------------------------------------


def test_a_stats_reply_that_is_not_engine_stats_leaves_metrics_answering() -> None:
    with serving([StandIn("prefill", stats={"bogus": 1})], [StandIn("decode")]) as (router, client):
        response = client.get("/metrics", headers=ADMIN)
        assert response.status_code == 200
        free = samples(response.text, "kvfence_pages_free")
        assert free == {(("role", "decode"),): 60.0}  # the lying pool has no series, the honest one has
        rejected = samples(response.text, "kvfence_transport_rejected_total")
        assert rejected[(("reason", "bad_reply"), ("role", "router"))] == 1.0
        assert router.rejected["bad_reply"] == 1


BAD_STATS = {
    "a field missing": {k: v for k, v in HONEST_STATS.items() if k != "num_waiting"},
    "a field more": {**HONEST_STATS, "bogus": 1},
    "a string count": {**HONEST_STATS, "pages_free": "60"},
    "a bool count": {**HONEST_STATS, "refused_writes": True},
    "a negative count": {**HONEST_STATS, "num_running": -1},
    "a count past 2^53": {**HONEST_STATS, "prefix_hits": 1 << 60},
    "NaN seconds": {**HONEST_STATS, "validation_seconds": math.nan},
    "more free pages than pages": {**HONEST_STATS, "pages_free": 65},
    "a label that is no code": {**HONEST_STATS, "transport_rejected": {'x"} 1\nfake': 1}},
    "too many labels": {**HONEST_STATS, "integrity_aborts": {f"r{i}": 1 for i in range(65)}},
    "a labelled float": {**HONEST_STATS, "pages_by_state": {"free": 1.5}},
    "a negative acceptance": {**HONEST_STATS, "spec_accepted_per_position": [3, -1]},
    "acceptance not a list": {**HONEST_STATS, "spec_accepted_per_position": {"0": 3}},
}


@pytest.mark.parametrize("lie", sorted(BAD_STATS))
def test_stats_out_of_type_or_bounds_are_dropped_whole(lie: str) -> None:
    checked, problems = replies.stats(BAD_STATS[lie])
    assert checked is None and len(problems) == 1
    assert replies.stats(HONEST_STATS) == (EngineStats.from_dict(HONEST_STATS), [])


# ---- audit events ----------------------------------------------------------------------------------------


def event(kind: str = "step", **fields: Any) -> dict[str, Any]:
    return {"seq": 1, "ts": time.time(), "request_id": "r1", "kind": kind, "where": "decode", **fields}


JUNK_EVENTS = [
    {k: v for k, v in event().items() if k != "ts"},
    event(ts="soon"),
    event(ts=math.nan),
    event(ts=math.inf),
    event(ts=-1.0),
    event(ts=10**400),
    event("made_up"),
    event(request_id="someone-else"),
    event(why="x" * 2000),
    event(pages=[[[1]]]),
    event(**{f"f{i}": i for i in range(40)}),
]


def test_audit_events_without_ts_or_junk_leave_the_merged_trail_answering() -> None:
    decode_ = StandIn("decode")
    with serving([StandIn("prefill")], [decode_]) as (router, client):
        router.events.emit("r1", "admitted", tenant="t", where="router")
        good = [event("page_received", page=3), event("pages_read", pages=[{"page": 3, "owner": "t"}])]
        decode_.events = [good[0], *JUNK_EVENTS, good[1]]  # after the router's: later in time
        response = client.get("/v1/audit/requests/r1", headers=ADMIN)
        assert response.status_code == 200, response.text
        trail = response.json()["events"]
        assert [(e["kind"], e["where"]) for e in trail] == [
            ("admitted", "router"),
            ("page_received", "decode"),
            ("pages_read", "decode"),
        ]
        assert router.rejected["bad_reply"] == len(JUNK_EVENTS)


# ---- pins ------------------------------------------------------------------------------------------------


def test_forged_and_oversized_pins_are_dropped_and_shown_as_the_workers_claim() -> None:
    forged = {
        "model_sha256": "0" * 5000,  # oversized
        "nested": {"deeper": {"still": {"more": 1}}},  # more than two levels
        "capacity_tokens": 10**9,  # a pin the hello states: the router shows its own value
        "transport": {"kind": "zeromq", "authenticated": False},
        **{f"extra{i}": i for i in range(100)},  # more pins than anyone needs
    }
    liar = StandIn("prefill", hello={"info": forged})
    with serving([liar], [StandIn("decode")]) as (router, client):
        info = client.get("/v1/audit/info", headers=ADMIN).json()
        pins = info["pools"]["prefill"]
        assert "model_sha256" not in pins and "nested" not in pins
        assert pins["transport"] == forged["transport"] and pins["capacity_tokens"] == 256
        assert len(pins) == replies.MAX_PINS + len(replies.HELLO_PINS)
        assert "own claim" in info["pools_note"]
        dropped_extras = 100 - (replies.MAX_PINS - 1)  # `transport` took one of the places
        assert router.rejected["bad_reply"] == 2 + dropped_extras


def test_audit_info_shows_each_workers_pins_as_it_states_them_now() -> None:
    """A worker replaced its landing process after start: /v1/audit/info shows what it says now (its
    transport, asked afresh), not its first hello; the numbers the router acts on stay its own, a pin
    beyond bounds is still dropped, and a lost worker shows the pins of the hello it was adopted with."""
    decode = StandIn("decode")
    with serving([StandIn("prefill")], [decode]) as (router, client):
        first = client.get("/v1/audit/info", headers=ADMIN).json()["pools"]["decode"]
        assert first["transport"] == {"kind": "zeromq", "authenticated": False}
        now = {"kind": "zeromq", "kv": "nixl", "pid": 2, "restarts": 1, "data_plane_sealed": False}
        decode.hello = honest_hello("decode", capacity_tokens=10**9)
        decode.hello["info"] |= {"transport": now, "model_sha256": "0" * 5000}
        pins = client.get("/v1/audit/info", headers=ADMIN).json()["pools"]["decode"]
        assert pins["transport"] == now and pins["capacity_tokens"] == 256
        assert "model_sha256" not in pins
        decode.stop()
        router.placement.down.add(decode.address)
        assert client.get("/v1/audit/info", headers=ADMIN).json()["pools"]["decode"] == first


def test_the_first_link_up_read_after_start_asks_no_second_hello() -> None:
    """The I/O thread reads frames before monitor events, so a link's first `up` can come after start()
    has its hello: asking again would count each dropped pin twice. Only a link that was down is asked."""
    liar = StandIn("prefill", hello={"info": {"nested": {"deeper": {"still": {"more": 1}}}}})
    with serving([liar], [StandIn("decode")]) as (router, _):
        assert liar.hellos == 1  # start()'s, answered before start() returned
        router._on_link(LinkEvent(liar.address, up=True))
        assert [asked for asked in router.questions.pending() if asked[1] == "hello_reply"] == []
        router._on_link(LinkEvent(liar.address, up=False))
        router._on_link(LinkEvent(liar.address, up=True))
        # Every question asked above is open until its answer is in (the stand-in may answer at once, so
        # the open ones are not asserted): once none is, the stand-in has answered each hello asked.
        deadline = time.monotonic() + WAIT_S
        while router.questions.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert router.questions.pending() == [] and liar.hellos == 2


# ---- the hello: capacity and page size -------------------------------------------------------------------


def test_an_advertised_capacity_of_1e12_does_not_pull_every_request() -> None:
    decode_ = [StandIn("decode", hello={"capacity_tokens": 10**12}), StandIn("decode")]
    with serving([StandIn("prefill")], decode_) as (router, client):
        assert router.workers["decode-0"].capacity_tokens == replies.MAX_CAPACITY_TOKENS
        assert router.rejected["bad_reply"] == 1  # the capped claim
        pins = client.get("/v1/audit/info", headers=ADMIN).json()["pools"]["decode-0"]
        assert pins["capacity_tokens"] == replies.MAX_CAPACITY_TOKENS
        for i in range(10):
            router.placement.take(f"r{i}", router.placement.choose(10, 10))
        assert (router.placement.routed["decode-0"], router.placement.routed["decode-1"]) == (5, 5)


def test_a_huge_claimed_headroom_draws_only_what_the_others_cannot_hold() -> None:
    addresses = {"prefill": ["p"], "decode": ["big", "honest"]}
    names = {"p": "prefill", "big": "decode-0", "honest": "decode-1"}
    placement = Placement(addresses, names, isolation=True)
    for name, capacity in (("prefill", 1000), ("decode-0", 10**12), ("decode-1", 100)):
        placement.workers[name] = WorkerInfo(name.partition("-")[0], capacity, 100, 4, True, {})
    placement.max_model_len = placement.window()
    chosen = []
    for i in range(8):  # 20 tokens each: the honest pool holds 5 of them at once
        route = placement.choose(10, 10)
        placement.take(f"r{i}", route)
        chosen.append(names[route.decode])
    assert chosen == ["decode-0", "decode-1"] * 4  # spread by the router's own count, not by the claim
    for i in range(8, 12):
        placement.take(f"r{i}", placement.choose(10, 10))
    assert placement.load["honest"] == 100  # the honest pool is full: only then does the claim draw more


REFUSED_HELLOS = {
    "page size 0": {"page_size": 0},
    "page size past 2^16": {"page_size": 1 << 17, "capacity_tokens": 1 << 18},
    "another page size than agreed": {"page_size": 8},
    "capacity not whole pages": {"capacity_tokens": 258},
    "capacity under a page": {"capacity_tokens": 0},
    "a window its pool cannot hold": {"max_model_len": 512},
    "no window": {"max_model_len": 0},
}


@pytest.mark.parametrize("lie", sorted(REFUSED_HELLOS))
def test_a_hello_that_cannot_be_true_is_refused(lie: str) -> None:
    reply = HelloReply(token="q0", **honest_hello("decode", **REFUSED_HELLOS[lie]))
    checked, problems = replies.worker(reply, 4, replies.MAX_CAPACITY_TOKENS)
    assert checked is None and len(problems) == 1


def test_an_honest_hello_is_taken_as_sent() -> None:
    fields = honest_hello("decode")
    checked, problems = replies.worker(HelloReply(token="q0", **fields), 4, replies.MAX_CAPACITY_TOKENS)
    info = {**fields["info"], "capacity_tokens": 256, "max_model_len": 128}
    assert problems == [] and checked == WorkerInfo("decode", 256, 128, 4, True, info)


def test_a_window_past_the_pool_refuses_the_router_start() -> None:
    refused = [StandIn("decode", hello={"max_model_len": 512})]
    with pytest.raises(RuntimeError, match="window 512 outside"), serving([StandIn("prefill")], refused):
        pass


def test_a_worker_restarted_with_another_page_size_is_kept_out() -> None:
    """The same address comes back with 8-token pages: refused before it replaces the pool it had."""
    first = StandIn("decode")
    with serving([StandIn("prefill")], [first]) as (router, _):
        before = router.workers["decode"]
        first.stop()  # the process dies; its successor binds the same address
        successor = rebound(first.address, hello={"page_size": 8})
        try:
            deadline = time.monotonic() + WAIT_S
            while router.rejected["bad_reply"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert router.rejected["bad_reply"] == 1
            assert router.workers["decode"] == before and first.address in router.placement.down
        finally:
            successor.stop()


class ForgedChoice(StandIn):
    """A decode stand-in that reserves a one-token prompt and answers it with the output of a choice the
    request does not have."""

    def _serve(self) -> None:
        try:
            while not self._stopped.is_set():
                item = self.connector.recv(0.05)
                if not isinstance(item, Received):
                    continue
                question = decode(item.header, item.payload, BOUNDS)
                if isinstance(question, Reserve):
                    rid = question.request_id
                    self.connector.send(item.sender, Reserved(rid, []))
                    self.connector.send(
                        item.sender, Output(rid, [5], "x", True, "finished", "stop", 1, 1, fork=7)
                    )
                elif not isinstance(question, Abort):
                    self.connector.send(item.sender, self._answer(question))
        finally:
            self.connector.close()


def test_an_output_of_a_choice_the_request_has_not_fails_it_closed() -> None:
    """n=2, and decode says choice 7 finished: the router drops it (bad_field), tells decode to abort, and
    the client gets an error, never a body with a choice it did not ask for."""
    with serving([StandIn("prefill")], [ForgedChoice("decode")]) as (router, client):
        body = {"model": "m", "prompt": [5], "max_tokens": 1, "n": 2, "temperature": 1.0}
        response = client.post("/v1/completions", json=body)
    assert response.status_code >= 500 and "choices" not in response.json(), response.text
    assert router.rejected["bad_field"] == 1


class HeldDecode(StandIn):
    """A decode stand-in that reserves every one-token prompt (nothing to transfer), notes each request
    message it gets in arrival order, and sends the outputs the test hands it."""

    def __init__(self, role: str) -> None:
        self.got: list[tuple[str, str]] = []  # (kind, request_id)
        self.outputs: queue.Queue[Output] = queue.Queue()
        super().__init__(role)

    def _serve(self) -> None:
        router = None
        try:
            while not self._stopped.is_set():
                while router is not None and not self.outputs.empty():
                    self.connector.send(router, self.outputs.get_nowait())
                item = self.connector.recv(0.05)
                if not isinstance(item, Received):
                    continue
                message = decode(item.header, item.payload, BOUNDS)
                if isinstance(message, Reserve | Abort):
                    router = item.sender
                    self.got.append((message.KIND, message.request_id))
                    if isinstance(message, Reserve):
                        self.connector.send(router, Reserved(message.request_id, []))
                else:
                    self.connector.send(item.sender, self._answer(message))
        finally:
            self.connector.close()


def test_a_second_request_under_a_live_id_is_refused_before_anything_is_sent() -> None:
    """The router refuses (409) a request whose id one in flight holds, sending decode nothing: the live
    request keeps its stream and ends with its own output, and decode sees one reserve and no abort. (It
    used to take over the id's stream and route, send a second reserve and, leaving, abort the id.)"""
    held = HeldDecode("decode")
    params = SamplingParams(max_tokens=1)

    async def scenario(router: Router) -> tuple[AdmissionError, Any]:
        live = router.generate([5], params, "t", "r1")
        first = asyncio.ensure_future(anext(live))
        deadline = time.monotonic() + WAIT_S
        while not held.got and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert held.got == [("reserve", "r1")]
        with pytest.raises(AdmissionError) as refused:
            await asyncio.wait_for(anext(router.generate([6], params, "t", "r1")), WAIT_S)
        held.outputs.put(Output("r1", [7], "x", True, "finished", "length", 1, 1))
        output = await asyncio.wait_for(first, WAIT_S)
        await live.aclose()
        return refused.value, output

    with serving([StandIn("prefill")], [held]) as (router, _):
        refused, output = asyncio.run(scenario(router))
        router.worker_stats("decode")  # its reply follows every earlier message to decode (one channel)
        assert held.got == [("reserve", "r1")]
    assert (refused.code, refused.status) == (DUPLICATE_REQUEST_ID, 409)
    assert (output.new_token_ids, output.finish_reason) == ([7], "length")
    assert router.events.kinds("r1").count("admitted") == 1 and not router.placement.routes


def test_what_the_connector_could_not_send_fails_at_once() -> None:
    """The router's connector drops what it sends (as ZmqConnector.send does once a worker stopped taking
    frames: counted, False): the request ends with `send_blocked` now, not at the router's timeout, and a
    stats question fails its asker with TimeoutError saying it was never sent."""
    with serving([StandIn("prefill")], [StandIn("decode")], timeout_s=60.0) as (router, client):
        connector = router._ready.result()

        def dropped(peer: str, message: Msg) -> bool:
            connector.rejected["send_blocked"] += 1
            return False

        connector.send = dropped  # type: ignore[method-assign]
        body = {"model": "m", "prompt": [5, 6], "max_tokens": 1}
        response = client.post("/v1/completions", json=body)
        assert response.status_code == 500 and response.json()["error"]["code"] == "send_blocked"
        with pytest.raises(TimeoutError, match="stats to decode could not be sent"):
            router.worker_stats("decode")
    trail = router.events.for_request(response.headers["x-request-id"])
    assert [(e["kind"], e.get("reason")) for e in trail] == [("admitted", None), ("aborted", "send_blocked")]
