"""Autoscaling from Ray Serve's config, on test_ray_serve's cluster (no cluster of its own: each start costs
a minute or more on a busy two-core machine): the running kvfence application is redeployed, as a Ray user
would, with Serve's Python API and the same `kvfence serve` arguments plus an `autoscaling_config` (1 to 2
servers, one ongoing request each); at rest Serve keeps one server; under a steady load of CLIENTS a second
starts, joins the fleet (/v1/audit/info lists it) and answers; every request of the load is answered; with
the load gone the application is back to one server.

Every wait is for a state (Serve's replica states and target, the fleet's members, an answer from the new
replica), bounded by a hang guard; nothing is timed. A hang guard that fires names Serve's own word on the
deployment (its status, message and target), which tells a replica that cannot be placed from one that
does not start.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx
from ray_fleet_checks import admin_get, wait_for

from kvfence.ray.deployment import DEPLOYMENT_NAME

APP_NAME = "kvfence"  # kvfence serve's application (kvfence.ray.local)
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 0,
    "downscale_delay_s": 5,
}
CLIENTS = 4  # with one ongoing request each as the target, 4 ongoing ask for 4 replicas: 2 at most
REDEPLOY_TIMEOUT_S = 600.0  # a hang guard: serve.run returns once the new version runs

# The application redeployed with the args given as JSON; serve.run returns once it runs.
REDEPLOY = """
import json, sys, ray
from ray import serve
from kvfence.ray import app
ray.init(address=sys.argv[1], log_to_driver=False)
serve.run(app(json.loads(sys.argv[2])), name=sys.argv[3], route_prefix="/")
print("DEPLOYED", flush=True)
"""


class Cluster(Protocol):
    url: str
    api_key: str
    admin_key: str
    serve_args: list[str]

    def ray_python(self, code: str, *args: str, timeout_s: float = ...) -> Any: ...

    def serve_applications(self) -> dict[str, Any]: ...


@dataclass
class Load:
    """CLIENTS threads sending greedy completions until stopped: which replica answered each, and any
    request not answered 200."""

    url: str
    api_key: str
    stop: threading.Event = field(default_factory=threading.Event)
    answered_by: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        headers = {"authorization": f"Bearer {self.api_key}"}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while not self.stop.is_set():
                try:
                    response = client.post("/v1/completions", json=body, headers=headers)
                except httpx.HTTPError as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                if response.status_code != 200:
                    self.failures.append(f"HTTP {response.status_code}: {response.text[:200]}")
                    continue
                self.answered_by.add(response.headers["x-kvfence-replica"])


def servers(cluster: Cluster) -> dict[str, Any]:
    """Serve's status of the servers' deployment (status, message, target_num_replicas, replicas)."""
    return dict(cluster.serve_applications()[APP_NAME]["deployments"][DEPLOYMENT_NAME])


def running(cluster: Cluster, count: int) -> Callable[[], list[str] | None]:
    """A state to wait for: Serve runs `count` servers and targets no more, and the fleet lists exactly
    those (each replica has joined: a replica Serve runs but the fleet lacks would fail the admin reads)."""

    def state() -> list[str] | None:
        deployment = servers(cluster)
        ids = sorted(r["replica_id"] for r in deployment["replicas"] if r["state"] == "RUNNING")
        if len(ids) != count or deployment["target_num_replicas"] != count:
            return None
        info = admin_get(cluster, "/v1/audit/info")  # a 503 while a replica stops: not the state yet
        return ids if info.status_code == 200 and sorted(info.json()["replicas"]) == ids else None

    return state


def wait_for_servers(cluster: Cluster, what: str, count: int) -> list[str]:
    """`running(cluster, count)` waited for; a hang guard that fires says what Serve reports then."""
    try:
        return list(wait_for(what, running(cluster, count)))
    except AssertionError as exc:
        deployment = servers(cluster)
        states = sorted(r["state"] for r in deployment["replicas"])
        now = f"{deployment['status']}, target {deployment['target_num_replicas']}, replicas {states}"
        raise AssertionError(f"{exc}; Serve: {now}, {deployment['message']!r}") from None


def check_autoscaling(cluster: Cluster) -> None:
    args = {"serve_args": cluster.serve_args, "num_cpus": 0.5, "autoscaling_config": SCALING}
    done = cluster.ray_python(REDEPLOY, json.dumps(args), APP_NAME, timeout_s=REDEPLOY_TIMEOUT_S)
    assert done.returncode == 0 and "DEPLOYED" in done.stdout, done.stderr[-3000:]
    (first,) = wait_for_servers(cluster, "one server at rest", 1)
    load = Load(cluster.url, cluster.api_key)
    clients = [threading.Thread(target=load.run, daemon=True) for _ in range(CLIENTS)]
    for client in clients:
        client.start()
    try:
        scaled = wait_for_servers(cluster, "a second server under load", 2)
        (second,) = [r for r in scaled if r != first]
        wait_for(f"the new replica {second} answering the load", lambda: second in load.answered_by)
    finally:
        load.stop.set()
        for client in clients:
            client.join(timeout=180)
    assert load.failures == [], load.failures[:5]
    (rest,) = wait_for_servers(cluster, "back to one server", 1)
    seen = sorted(load.answered_by)
    print(f"  autoscaled: {first} -> {first}, {second} -> {rest}; the load answered by {seen}")
