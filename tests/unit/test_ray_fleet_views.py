"""The fleet's admin views without Ray (kvfence.ray.fleet_views): a stand-in replica app with kvfence's admin
check, peers that answer what the test says. Trails merge across replicas with `where` per replica, info
lists every replica's pools, /metrics labels every sample by replica; a caller the replica refuses asks no
peer; a silent or garbled peer is a 503 or 502, never a partial answer. The real fleet (a Ray cluster,
the registry actor): tests/integration/test_ray_serve.py."""

from __future__ import annotations

import asyncio
import json

from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kvfence.ray.fleet_views import Answer, FleetViews

ADMIN = "admin-secret"
EVENTS = [{"kind": "pages_allocated", "seq": 1, "pages": [3]}, {"kind": "finished", "seq": 2}]
METRICS = '# HELP kvfence_pages Pages.\n# TYPE kvfence_pages gauge\nkvfence_pages{role="single"} 64.0\n'


def replica_app(trails: dict[str, list[dict[str, object]]]) -> Starlette:
    def admin(request: Request) -> Response | None:
        if request.headers.get("authorization") != f"Bearer {ADMIN}":
            return JSONResponse({"error": {"message": "no", "type": "auth", "code": None}}, status_code=401)
        return None

    async def trail(request: Request) -> Response:
        request_id = request.path_params["request_id"]
        if refused := admin(request):
            return refused
        if request_id not in trails:
            return JSONResponse({"error": {"message": "none"}}, status_code=404)
        return JSONResponse({"request_id": request_id, "events": trails[request_id]})

    async def info(request: Request) -> Response:
        return admin(request) or JSONResponse({"mode": "single", "pools": {"single": {"page_size": 16}}})

    async def metrics(request: Request) -> Response:
        return admin(request) or PlainTextResponse(METRICS)

    routes = [
        Route("/v1/audit/requests/{request_id}", trail),
        Route("/v1/audit/info", info),
        Route("/metrics", metrics),
    ]
    return Starlette(routes=routes)


class Peers:
    def __init__(self, answers: dict[str, Answer]) -> None:
        self.answers, self.asked = answers, []

    async def ask(self, path: str) -> dict[str, Answer]:
        self.asked.append(path)
        return self.answers


def fleet(trails: dict[str, list[dict[str, object]]], peers: Peers) -> TestClient:
    views = FleetViews(replica_app(trails), "r1", ADMIN)
    views.peers = peers
    return TestClient(views)


def trail_answer(request_id: str, events: list[dict[str, object]]) -> Answer:
    return 200, json.dumps({"request_id": request_id, "events": events})


AUTH = {"authorization": f"Bearer {ADMIN}"}


def test_a_trail_is_found_on_the_replica_that_holds_it_with_where_per_replica() -> None:
    peers = Peers({"r2": trail_answer("cmpl-x", EVENTS), "r3": (404, "")})
    response = fleet({}, peers).get("/v1/audit/requests/cmpl-x", headers=AUTH)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["replicas"] == ["r2"] and [e["where"] for e in body["events"]] == ["r2", "r2"]
    assert [e["kind"] for e in body["events"]] == ["pages_allocated", "finished"]
    assert peers.asked == ["/v1/audit/requests/cmpl-x"]


def test_events_of_one_id_on_two_replicas_keep_their_own_places() -> None:
    disagg = [{**EVENTS[0], "where": "decode"}]
    response = fleet({"cmpl-x": EVENTS}, Peers({"r2": trail_answer("cmpl-x", disagg)})).get(
        "/v1/audit/requests/cmpl-x", headers=AUTH
    )
    assert [e["where"] for e in response.json()["events"]] == ["r1", "r1", "r2/decode"]


def test_no_replica_holding_it_is_a_404_and_a_silent_one_a_503() -> None:
    assert fleet({}, Peers({"r2": (404, "")})).get("/v1/audit/requests/a", headers=AUTH).status_code == 404
    silent = fleet({}, Peers({"r2": (404, ""), "r3": None})).get("/v1/audit/requests/a", headers=AUTH)
    assert silent.status_code == 503 and "replica r3 did not answer" in silent.json()["error"]["message"]


def test_a_peer_answering_another_request_or_garbage_is_a_502() -> None:
    for answer in (trail_answer("cmpl-other", EVENTS), (200, "not json"), (200, '{"request_id": "a"}')):
        response = fleet({}, Peers({"r2": answer})).get("/v1/audit/requests/a", headers=AUTH)
        assert response.status_code == 502, (answer, response.text)
        assert response.json()["error"]["type"] == "server_error"


def test_a_caller_the_replica_refuses_asks_no_peer() -> None:
    peers = Peers({"r2": trail_answer("a", EVENTS)})
    client = fleet({}, peers)
    for path in ("/v1/audit/requests/a", "/v1/audit/info", "/metrics"):
        assert client.get(path, headers={"authorization": "Bearer tenant"}).status_code == 401
    assert peers.asked == []


def test_info_lists_every_replicas_pools() -> None:
    other = json.dumps({"mode": "single", "pools": {"single": {"page_size": 16}}})
    body = fleet({}, Peers({"r2": (200, other)})).get("/v1/audit/info", headers=AUTH).json()
    assert sorted(body["pools"]) == ["r1/single", "r2/single"] and body["replica"] == "r1"
    assert sorted(body["replicas"]) == ["r1", "r2"] and body["mode"] == "single"


def test_metrics_are_every_replicas_labelled_by_replica() -> None:
    text = fleet({}, Peers({"r2": (200, METRICS.replace("64.0", "32.0"))})).get("/metrics", headers=AUTH).text
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    assert sorted((s.labels["replica"], s.labels["role"], s.value) for s in samples) == [
        ("r1", "single", 64.0),
        ("r2", "single", 32.0),
    ]
    garbled = fleet({}, Peers({"r2": (200, "kvfence_pages{{{ 1")})).get("/metrics", headers=AUTH)
    assert garbled.status_code == 502


def test_a_peer_is_answered_with_the_replicas_own_key_and_only_on_fleet_paths() -> None:
    views = FleetViews(replica_app({"cmpl-x": EVENTS}), "r1", ADMIN)
    status, body = asyncio.run(views.local("/v1/audit/requests/cmpl-x"))
    assert status == 200 and json.loads(body)["events"] == EVENTS
    assert asyncio.run(views.local("/v1/completions"))[0] == 404
    unkeyed = FleetViews(replica_app({"cmpl-x": EVENTS}), "r1", None)
    assert asyncio.run(unkeyed.local("/v1/audit/requests/cmpl-x"))[0] == 401
