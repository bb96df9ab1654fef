"""Autoscaling from Ray Serve's config: `kvfence.ray:app` with an `autoscaling_config` (1 to 2 replicas, one
ongoing request each) on a real local Ray cluster with token authentication, the real SmolLM2: one replica
at rest; under a steady load of 4 clients a second starts, joins the fleet (/v1/audit/info lists it) and
answers; every request of the load is answered; with the load gone the application is back to one replica.

The cluster runs in a child process that deploys with Serve's Python API (`serve run` of the same config
would too) and stays up until its stdin closes; its session lives in this test's own temporary directory,
and any process left naming it is killed by pid at the end, never by name. Every wait is for a state
(a replica count, an answer from the new replica), bounded by a hang guard: nothing is timed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from ray_fleet_checks import fleet_replicas, processes_under, wait_for

from kvfence.disagg.launch import free_ports
from kvfence.harness.key_files import write_key_file

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "256", "--num-threads", "1", "--disable-log-stats"]
SCALING = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_ongoing_requests": 1,
    "upscale_delay_s": 0,
    "downscale_delay_s": 5,
    "look_back_period_s": 2,
}
CLIENTS = 4
START_TIMEOUT_S = 300.0

# Deploys kvfence.ray:app with the args given as JSON; "READY" on stdout; down when stdin closes.
CLUSTER = """
import json, sys, ray
from ray import serve
from kvfence.ray import app
directory, port, args = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
ray.init(_temp_dir=directory, num_cpus=2, object_store_memory=256 * 2**20, include_dashboard=False)
serve.start(http_options={"host": "127.0.0.1", "port": port})
serve.run(app(args), name="kvfence", route_prefix="/")
print("READY", flush=True)
sys.stdin.read()
serve.shutdown()
ray.shutdown()
"""


@dataclass
class Fleet:
    url: str
    api_key: str
    admin_key: str
    directory: Path


@dataclass
class Load:
    """CLIENTS threads sending greedy completions until stopped: which replica answered each, and any
    request not answered 200."""

    fleet: Fleet
    stop: threading.Event = field(default_factory=threading.Event)
    answered_by: set[str] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
        headers = {"authorization": f"Bearer {self.fleet.api_key}"}
        with httpx.Client(base_url=self.fleet.url, timeout=120) as client:
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


@contextlib.contextmanager
def autoscaled_fleet() -> Iterator[Fleet]:
    directory = Path(tempfile.mkdtemp(prefix="kvfa-"))
    api_key, admin_key = f"sk-{secrets.token_hex(16)}", f"admin-{secrets.token_hex(16)}"
    keys = write_key_file(directory / "api-keys", [f"{api_key} tenant-a"])
    admin = write_key_file(directory / "admin-key", [admin_key])
    token = write_key_file(directory / "ray-token", [secrets.token_hex(32)])
    serve_args = [*ENGINE_ARGS, "--api-keys", str(keys), "--admin-key-file", str(admin)]
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token), "OMP_NUM_THREADS": "1"}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "HOME": str(directory)}
    env |= {f"RAY_SERVE_PROXY_{w}_TIMEOUT_S": "60" for w in ("READY_CHECK", "HEALTH_CHECK")}  # busy box
    args = {"serve_args": serve_args, "num_cpus": 0.5, "autoscaling_config": SCALING}
    cluster = subprocess.Popen(
        [sys.executable, "-c", CLUSTER, str(directory / "ray"), str(port), json.dumps(args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert cluster.stdout is not None
        ready = cluster.stdout.readline()  # bounded by the test's timeout: READY, or the child exited
        assert ready.strip() == "READY", ready
        yield Fleet(f"http://127.0.0.1:{port}", api_key, admin_key, directory)
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            cluster.communicate("", timeout=120)  # stdin closed: Serve and Ray shut down
        cluster.kill()
        for pid in processes_under(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(900)
def test_autoscaling_from_one_replica_to_two_under_load_and_back() -> None:
    with autoscaled_fleet() as fleet:
        (first,) = wait_for("one replica in the fleet", lambda: fleet_replicas(fleet) or None)
        load = Load(fleet)
        clients = [threading.Thread(target=load.run, daemon=True) for _ in range(CLIENTS)]
        for client in clients:
            client.start()
        try:
            scaled = wait_for("a second replica under load", lambda: _two(fleet))
            (second,) = [r for r in scaled if r != first]
            wait_for(f"the new replica {second} answering the load", lambda: second in load.answered_by)
        finally:
            load.stop.set()
            for client in clients:
                client.join(timeout=180)
        assert load.failures == [], load.failures[:5]
        (rest,) = wait_for("back to one replica", lambda: r if len(r := fleet_replicas(fleet)) == 1 else None)
        seen = sorted(load.answered_by)
        print(f"  autoscaled: {first} -> {first}, {second} -> {rest}; the load answered by {seen}")


def _two(fleet: Fleet) -> list[str] | None:
    replicas = fleet_replicas(fleet)
    return replicas if len(replicas) == 2 else None
