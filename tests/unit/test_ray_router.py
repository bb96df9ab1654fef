"""kvfence's Ray Serve request router without a cluster: the keyed affinity keys (tenant-scoped, chained
over a prompt's chunks), the bounded table, the imbalance threshold, the router itself over fake replicas
(what it ranks first, what it learns when Ray reports a request routed or a replica dead), the text a
request's affinity is computed over, the front (tenant, body limit, streaming, a replica gone) and the
servers' `serve_http` (an ASGI app's messages in order). The cluster: tests/integration/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from typing import Any, ClassVar

import pytest

from kvfence.ray.affinity import CHUNK_CHARS, AffinityTable, prefix_keys, steer
from kvfence.ray.forward import ForwardedRequest, route_text

pytest.importorskip("ray.serve")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter

from kvfence.ray.router import TenantPrefixRouter

KEY = secrets.token_bytes(32)
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 3
SERVERS = DeploymentID(name="kvfence")


def test_keys_are_per_tenant_and_chained_over_the_prefix() -> None:
    turn1 = SYSTEM + "user: what is the capital of France?"
    turn2 = turn1 + " assistant: Paris. user: and of Spain?"
    a1, a2 = prefix_keys(KEY, "tenant-a", turn1), prefix_keys(KEY, "tenant-a", turn2)
    assert len(a1) == len(turn1) // CHUNK_CHARS and len(a2) == len(turn2) // CHUNK_CHARS > len(a1)
    assert a2[: len(a1)] == a1  # turn 2 holds turn 1's whole chunks
    assert prefix_keys(KEY, "tenant-a", "x" * (CHUNK_CHARS - 1)) == []  # less than a page: no affinity
    b1 = prefix_keys(KEY, "tenant-b", turn1)
    assert not set(b1) & set(a1) and not set(b1) & set(a2)  # another tenant shares no key
    assert not set(prefix_keys(secrets.token_bytes(32), "tenant-a", turn1)) & set(a1)  # another MAC key
    text = "c" * CHUNK_CHARS
    assert prefix_keys(KEY, "ab", text) != prefix_keys(KEY, "a", "b" + text[1:])  # tenant length-framed
    with pytest.raises(ValueError, match="32 bytes"):
        prefix_keys(b"short", "tenant-a", turn1)


def test_the_table_forgets_the_least_recently_used() -> None:
    table, candidates = AffinityTable(capacity=3), {"r1": 0, "r2": 0}
    table.record([b"k1", b"k2"], "r1")
    table.record([b"k3"], "r2")
    assert table.owner([b"k1"], candidates) == "r1"  # k1 is now the most recently used
    table.record([b"k4"], "r2")
    assert len(table) == 3
    assert table.owner([b"k2"], candidates) is None  # the oldest unused key went
    assert [table.owner([k], candidates) for k in (b"k1", b"k3", b"k4")] == ["r1", "r2", "r2"]
    table.forget("r2")
    assert len(table) == 1 and table.owner([b"k3"], candidates) is None


def test_the_longest_known_prefix_wins_and_only_among_candidates() -> None:
    table = AffinityTable()
    table.record([b"short"], "r1")
    table.record([b"short", b"long"], "r2")
    table.record([b"other"], "r3")
    assert table.owner([b"short", b"long"], {"r1": 0, "r2": 0}) == "r2"
    assert table.owner([b"short", b"long"], {"r1": 0, "r3": 0}) is None  # r2 is gone; short is r2's too
    assert table.owner([b"other"], {"r1": 0}) is None


def test_steering_stops_past_the_imbalance_threshold() -> None:
    table = AffinityTable()
    table.record([b"p"], "r1")
    assert steer(table, [b"p"], {"r1": 2, "r2": 0}, imbalance_threshold=2) == "r1"
    assert steer(table, [b"p"], {"r1": 3, "r2": 0}, imbalance_threshold=2) is None
    assert steer(table, [b"q"], {"r1": 0, "r2": 0}, imbalance_threshold=2) is None
    assert steer(table, [], {"r1": 0, "r2": 0}, imbalance_threshold=2) is None


class FakeReplica:
    """What a RequestRouter reads of a replica (Ray's RunningReplica interface)."""

    node_id = ""
    availability_zone = None
    multiplexed_model_ids: ClassVar[set[str]] = set()
    max_ongoing_requests = 8
    routing_stats: ClassVar[dict[str, Any]] = {}

    def __init__(self, name: str) -> None:
        self.replica_id = ReplicaID(unique_id=name, deployment_id=SERVERS)
        self.queue_len = 0

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def _request(tenant: str | None, prompt: str) -> PendingRequest:
    metadata = RequestMetadata(request_id="r", internal_request_id=secrets.token_hex(4))
    return PendingRequest(args=[ForwardedRequest({}, b"", tenant, prompt)], kwargs={}, metadata=metadata)


def _router(replicas: list[FakeReplica], **kwargs: Any) -> TenantPrefixRouter:
    router = TenantPrefixRouter(deployment_id=SERVERS, handle_source=DeploymentHandleSource.UNKNOWN)
    router.initialize_state(**kwargs)
    router.update_replicas(replicas)
    return router


async def _route(router: TenantPrefixRouter, request: PendingRequest, chosen: FakeReplica) -> list[list[str]]:
    """The router's ranks for `request` (replica names), then Ray's report that `chosen` took it."""
    ranks = await router.choose_replicas(router._replicas_list, request)
    router.on_request_routed(request, chosen.replica_id, None)
    return [[replica.replica_id.unique_id for replica in rank] for rank in ranks]


def test_the_router_steers_a_tenants_prefix_and_nobody_elses() -> None:
    async def run() -> None:
        r1, r2 = FakeReplica("r1"), FakeReplica("r2")
        router = _router([r1, r2])
        prompt = SYSTEM + "user: hello"  # three whole chunks
        first = await _route(router, _request("tenant-a", prompt), r2)
        assert len(first) == 1 and sorted(first[0]) == ["r1", "r2"]  # nothing known: Ray's two choices
        again = await _route(router, _request("tenant-a", prompt + " assistant: hi"), r2)
        assert again[0] == ["r2"] and sorted(again[1]) == ["r1", "r2"]  # the owner first, then the rest
        other = await _route(router, _request("tenant-b", prompt), r1)
        assert len(other) == 1 and sorted(other[0]) == ["r1", "r2"]  # tenant-b: no steering
        anonymous = await router.choose_replicas(router._replicas_list, _request(None, prompt))
        assert len(anonymous) == 1 and len(anonymous[0]) == 2  # an unknown key: no affinity at all
        r2.queue_len = 3  # imbalanced past the threshold (2): balanced, not steered
        busy = await router.choose_replicas(router._replicas_list, _request("tenant-a", prompt))
        assert len(busy) == 1 and len(busy[0]) == 2
        r2.queue_len = 2
        assert (await router.choose_replicas(router._replicas_list, _request("tenant-a", prompt)))[0] == [r2]
        router.on_replica_actor_died(r2.replica_id)  # its pool is gone: its prefixes are forgotten
        assert len(router._table) == len(prefix_keys(KEY, "tenant-b", prompt))  # tenant-b's, on r1

    asyncio.run(run())


def test_the_router_keeps_its_mac_key_to_itself() -> None:
    """Two routers (two front replicas) derive unrelated keys: the key is made per router, not shared."""

    async def run() -> None:
        one, two = _router([FakeReplica("r1")]), _router([FakeReplica("r1")])
        request = _request("tenant-a", SYSTEM)
        assert one._keys(request) and not set(one._keys(request)) & set(two._keys(request))

    asyncio.run(run())


def test_route_text_is_a_chats_messages_or_a_prompt() -> None:
    turn1 = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    chat = "/v1/chat/completions"
    text1, text2 = (route_text(chat, json.dumps({"messages": m}).encode()) for m in (turn1, turn2))
    assert text1 and text2.startswith(text1) and "be brief" in text1
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]
    assert route_text(chat, json.dumps({"messages": parts}).encode()) == route_text(
        chat, json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode()
    )
    assert route_text("/v1/completions", b'{"prompt": "Once upon"}') == "Once upon"
    assert route_text("/v1/completions", b'{"prompt": [1, 2, 3]}') == ""
    assert route_text("/v1/models", b"") == ""
    assert route_text(chat, b"{not json") == "" and route_text(chat, b"[]") == ""


def test_the_benchmarks_ray_llm_router_leaves_textless_calls_to_power_of_two() -> None:
    """Ray Serve LLM's PrefixCacheAffinityRouter divides by the text's length: the benchmark's wrapper
    (kvfence.ray.llm_router) places a call without text (/metrics) by power-of-two, never asking its tree."""
    from kvfence.ray.llm_router import PrefixCacheOnPrompts

    class Untouchable:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"the prefix tree was asked ({name})")

    async def run() -> None:
        router = PrefixCacheOnPrompts(deployment_id=SERVERS, handle_source=DeploymentHandleSource.UNKNOWN)
        router.initialize_state(tree_actor=Untouchable())
        replicas = [FakeReplica("r1"), FakeReplica("r2")]
        RequestRouter.update_replicas(router, replicas)  # type: ignore[arg-type]  # the tree's copy needs Ray
        request = _request("tenant-a", "")
        ranks = await router.choose_replicas(router._replicas_list, request)
        assert len(ranks) == 1 and len(ranks[0]) == 2
        router.on_request_routed(request, ranks[0][0].replica_id, None)  # type: ignore[arg-type]

    asyncio.run(run())
