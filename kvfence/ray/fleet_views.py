"""The fleet's admin views on one Ray Serve replica: whichever replica Ray's proxy hands an admin read, it
answers for every replica of the application (no Ray import here: the peers are kvfence.ray.fleet's).

Contracts:
- Only three GETs are the fleet's: `/v1/audit/requests/{id}`, `/v1/audit/info` and `/metrics`. The replica
  that receives one first answers it itself, with the caller's own headers: a caller its own auth refuses
  gets that refusal, and no peer is asked. Everything else passes through untouched.
- Peers are asked the same path (`Peers.ask`), never given a key: a peer answers from its own app with
  its own admin key (`FleetViews.local`), which never leaves its process.
- A trail is every replica's events for that id, each event's `where` prefixed with the replica that
  holds it (`REPLICA/where`, or `REPLICA` for a single engine's), so that page numbers and sequence
  numbers, which are per pool, are never compared across replicas; 404 only when no replica has it.
- /v1/audit/info: the receiving replica's answer with `replicas` (each replica's own info, by id) and
  `pools` holding every replica's pools as `REPLICA/pool`. /metrics: every replica's samples, each with a
  `replica` label.
- What a peer sends is data, checked: a trail must be `{"request_id": the id, "events": [objects]}`, an
  info an object with `pools`, metrics Prometheus text; anything else, or a live peer that did not answer,
  is a 502 or 503 in OpenAI's error shape, never a partial fleet passed off as the whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

TRAIL_PATH = re.compile(r"/v1/audit/requests/([A-Za-z0-9._:-]{1,128})")
INFO_PATH = "/v1/audit/info"
METRICS_PATH = "/metrics"
REPLICA_LABEL = "replica"
Answer = tuple[int, str] | None  # (status, body); None: a live replica that did not answer


class Peers(Protocol):
    async def ask(self, path: str) -> dict[str, Answer]:
        """Every other live replica's answer to `GET path`, by replica id."""
        ...


class FleetError(Exception):
    """A peer's answer cannot be part of the fleet's: the status and message of the error answered."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def is_fleet_path(path: str) -> bool:
    return path in (INFO_PATH, METRICS_PATH) or TRAIL_PATH.fullmatch(path) is not None


class FleetViews:
    """ASGI middleware over one replica's app; `peers` is set once the replica has joined its fleet (until
    then, and with no peers, a replica answers for itself alone)."""

    def __init__(self, app: ASGIApp, replica: str, admin_key: str | None) -> None:
        self.app, self.replica = app, replica
        self.peers: Peers | None = None
        self._own = [(b"authorization", f"Bearer {admin_key}".encode())] if admin_key else []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "GET" or not is_fleet_path(path) or not self.peers:
            await self.app(scope, receive, send)
            return
        status, headers, body = await _capture(self.app, scope, receive)
        if status == 200 or (status == 404 and TRAIL_PATH.fullmatch(path)):
            try:
                status, kind, body = await self._fleet(path, status, body.decode())
            except FleetError as exc:
                status, kind = exc.status, "application/json"
                body = json.dumps({"error": {"message": str(exc), "type": "server_error", "code": None}})
            headers = [(k, v) for k, v in headers if k.lower() not in (b"content-type", b"content-length")]
            headers.append((b"content-type", kind.encode()))
        await _respond(send, status, headers, body.encode() if isinstance(body, str) else body)

    async def local(self, path: str) -> tuple[int, str]:
        """This replica's own answer to a peer's `GET path` (one of the fleet's paths), with its own key."""
        if not is_fleet_path(path):
            return 404, ""
        scope = {
            "type": "http",
            "http_version": "1.1",
            "method": "GET",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"kvfence-fleet"), *self._own],
            "client": ("127.0.0.1", 0),
            "server": ("127.0.0.1", 0),
        }
        status, _, body = await _capture(self.app, scope, _no_body)
        return status, body.decode()

    async def _fleet(self, path: str, status: int, body: str) -> tuple[int, str, str]:
        assert self.peers is not None
        answers = {self.replica: (status, body), **await self.peers.ask(path)}
        silent = sorted(replica for replica, answer in answers.items() if answer is None)
        if silent:
            raise FleetError(503, f"replica {silent[0]} did not answer {path}: the fleet's view is partial")
        got = {replica: answer for replica, answer in answers.items() if answer is not None}
        if path == METRICS_PATH:
            return 200, "text/plain; version=0.0.4; charset=utf-8", labelled_metrics(_ok(got, path))
        if path == INFO_PATH:
            return 200, "application/json", json.dumps(fleet_info(self.replica, _ok(got, path)))
        match = TRAIL_PATH.fullmatch(path)
        assert match is not None
        trail = fleet_trail(match.group(1), got)
        return (200 if trail["events"] else 404), "application/json", json.dumps(trail)


def _ok(answers: dict[str, tuple[int, str]], path: str) -> dict[str, str]:
    bad = sorted(replica for replica, (status, _) in answers.items() if status != 200)
    if bad:
        raise FleetError(502, f"replica {bad[0]} answered {path} with HTTP {answers[bad[0]][0]}")
    return {replica: body for replica, (_, body) in answers.items()}


def _json(replica: str, body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        raise FleetError(502, f"replica {replica} answered with something not JSON") from None


def fleet_trail(request_id: str, answers: dict[str, tuple[int, str]]) -> dict[str, Any]:
    """Every replica's events for `request_id`, `where` prefixed by replica (404s hold none)."""
    events, holders = [], []
    for replica, (status, body) in sorted(answers.items()):
        if status == 404:
            continue
        if status != 200:
            raise FleetError(502, f"replica {replica} answered the trail of {request_id} with HTTP {status}")
        trail = _json(replica, body)
        listed = trail.get("events") if isinstance(trail, dict) else None
        if not isinstance(listed, list) or not listed or trail.get("request_id") != request_id:
            raise FleetError(502, f"replica {replica} answered a trail that is not {request_id}'s")
        if not all(isinstance(event, dict) for event in listed):
            raise FleetError(502, f"replica {replica} answered a trail with an event that is not an object")
        holders.append(replica)
        events += [{**event, "where": _where(replica, event.get("where"))} for event in listed]
    return {"request_id": request_id, "events": events, "replicas": holders}


def _where(replica: str, where: object) -> str:
    return replica if where is None else f"{replica}/{where}"


def fleet_info(replica: str, answers: dict[str, str]) -> dict[str, Any]:
    """The receiving replica's info, with every replica's (`replicas`) and every pool (`REPLICA/pool`)."""
    infos = {}
    for name, body in sorted(answers.items()):
        info = _json(name, body)
        if not isinstance(info, dict) or not isinstance(info.get("pools"), dict):
            raise FleetError(502, f"replica {name} answered an info without pools")
        infos[name] = info
    pools = {f"{name}/{pool}": value for name, info in infos.items() for pool, value in info["pools"].items()}
    return {**infos[replica], "replica": replica, "replicas": infos, "pools": pools}


def labelled_metrics(answers: dict[str, str]) -> bytes:
    """Every replica's exposition as one, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(answers.items()):
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            raise FleetError(502, f"replica {replica} answered /metrics that do not parse") from None
        for family in parsed:
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                labels = {**sample.labels, REPLICA_LABEL: replica}
                merged.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families.values()))
    return generate_latest(registry)


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


async def _no_body() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _capture(
    app: ASGIApp, scope: Scope, receive: Callable[[], Awaitable[Message]]
) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """Run `app` for one request and keep its whole answer (the fleet's paths answer small bodies)."""
    status, headers, chunks = 500, [], []

    async def keep(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, keep)
    return status, headers, b"".join(chunks)


async def _respond(send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
