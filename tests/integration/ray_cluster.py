"""The two-replica Ray cluster of tests/integration/test_ray_serve.py: `kvfence serve --ray-replicas 2` on a
real local Ray cluster (the real SmolLM2 on its exact float32 path, 2 replicas of half a CPU and one torch
thread each, one sealed Redis tier, two tenants' keys, an admin key, Ray's token authentication and TLS),
and the probes its checks read Ray with.

Each session lives in a temporary directory of its own (short: Ray's socket paths must fit 107 bytes);
every process left with that directory in its command line is killed by pid at the end, never by name.
Only JSON crosses back from a probe (a fresh interpreter with the token's path): nothing is unpickled here.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvfence.disagg.launch import free_ports
from kvfence.harness.procs import Proc, launch, stop
from kvfence.harness.ray_state import processes_under
from kvfence.harness.redis_server import redis_server

# Small enough for two replicas and the test's own engine beside the rest of the suite on 2 cores.
# The exact path: a prefix restored from the tier is a prefill in chunks, which moves the fast path's logits.
ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "256", "--num-threads", "1", "--disable-log-stats"]
ENGINE_ARGS += ["--activation-dtype", "float32"]
REPLICA_CPUS = 0.5
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
RAY_CLIENT_TIMEOUT_S = 90.0
SERVER_ACTOR = "ServeReplica:kvfence:kvfence"  # a server replica's actor (the front's is kvfence-front)

# Ray's state API and Serve's REST status as JSON on the last line of stdout.
STATE_PROBE = """
import json, sys, httpx, ray
from ray.util.state import list_actors, list_jobs, list_placement_groups, list_tasks, list_workers
context = ray.init(address=sys.argv[1], log_to_driver=False)
token = open(sys.argv[2]).read().strip()
serve = httpx.get(f"http://{context.dashboard_url}/api/serve/applications/",
                  headers={"authorization": f"Bearer {token}"}, timeout=30)
def rows(listed):
    return [json.loads(json.dumps(getattr(row, "__dict__", row), default=str)) for row in listed]
at = {"address": sys.argv[1], "detail": True}  # this cluster's, though another may run on the machine
state = {"actors": rows(list_actors(**at)), "jobs": rows(list_jobs(**at)),
         "placement_groups": rows(list_placement_groups(**at)),
         "tasks": rows(list_tasks(**at)), "workers": rows(list_workers(**at)),
         "serve_status": serve.status_code, "serve": serve.text,
         "metrics_exports": [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes()]}
print(json.dumps(state))
"""


@dataclass
class RayServer:
    proc: Proc
    url: str
    directory: Path  # this test's own: key files, the Ray session (ray/)
    serve_args: list[str]  # every replica's `kvfence serve` arguments, as the command passes them on
    api_key: str
    other_key: str  # a second tenant's
    admin_key: str
    tier_key: str
    gcs: str
    dashboard: str
    token_path: Path
    tls: dict[str, str]  # Ray's TLS variables: every Ray process of this cluster, and its clients, has them
    tls_key: str

    def post(self, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key or self.api_key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)

    def ray_python(
        self, code: str, *args: str, token: bool = True, timeout_s: float = RAY_CLIENT_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """`python -c CODE GCS ARGS` as a Ray client: with this cluster's token (by its file's path), or
        with no token anywhere Ray looks (no RAY_AUTH_* variable, a HOME without ~/.ray)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env |= {"HOME": str(self.directory / "home"), "RAY_USAGE_STATS_ENABLED": "0", **self.tls}
        if token:
            env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        command = [sys.executable, "-c", code, self.gcs, *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)

    def serve_applications(self) -> dict[str, Any]:
        """Serve's own status of the cluster's applications (the dashboard's REST API, with the token)."""
        headers = {"authorization": f"Bearer {self.token_path.read_text().strip()}"}
        response = httpx.get(
            f"http://{self.dashboard}/api/serve/applications/", headers=headers, timeout=HTTP_TIMEOUT_S
        )
        assert response.status_code == 200, response.text
        return dict(response.json()["applications"])


def secret_file(path: Path, text: str) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return path


def _line(proc: Proc, pattern: str) -> re.Match[str]:
    found = [m for line in proc.log if (m := re.search(pattern, line))]
    assert found, f"no line matching {pattern!r}:\n{proc.tail()}"
    return found[0]


def _tls(directory: Path) -> tuple[dict[str, str], str]:
    """Ray's TLS on loopback: a self-signed certificate for this node (Ray's own test helper makes it with
    the names Ray connects by), its key in a 0600 file; the variables and the key."""
    from ray._common.tls_utils import generate_self_signed_tls_certs

    cert, key = generate_self_signed_tls_certs()
    cert_path = directory / "tls.crt"
    cert_path.write_text(cert)
    key_path = secret_file(directory / "tls.key", key)
    variables = {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(cert_path),
        "RAY_TLS_SERVER_KEY": str(key_path),
    }
    return variables | {"RAY_TLS_CA_CERT": str(cert_path)}, key


@contextlib.contextmanager
def ray_server() -> Iterator[Callable[[], RayServer]]:
    """The server launched; what it yields waits until it serves (once: later calls return the same), so
    that a caller may do something else while the cluster boots."""
    with contextlib.ExitStack() as stack:
        yield from _ray_server(stack)


def _ray_server(stack: contextlib.ExitStack) -> Iterator[Callable[[], RayServer]]:
    directory = Path(tempfile.mkdtemp(prefix="kvfr-"))
    (directory / "home").mkdir()
    api_key, other_key = f"sk-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    admin_key, tier_key = f"admin-{secrets.token_hex(16)}", secrets.token_hex(32)
    keys = secret_file(directory / "api-keys", f"{api_key} tenant-a\n{other_key} tenant-b\n")
    admin = secret_file(directory / "admin-key", f"{admin_key}\n")
    tier = secret_file(directory / "tier-key", f"{tier_key}\n")
    redis_directory = Path(tempfile.mkdtemp(prefix="kvfr-redis-"))  # not the Ray session's: outlives it
    stack.callback(shutil.rmtree, redis_directory, ignore_errors=True)
    redis = stack.enter_context(redis_server(redis_directory))
    tls, tls_key = _tls(directory)
    (port,) = free_ports(1)
    serve_args = [*ENGINE_ARGS, "--api-keys", str(keys), "--admin-key-file", str(admin)]
    serve_args += ["--kv-tier", redis.patient(), "--kv-tier-key-file", str(tier)]
    args = ["serve", "--ray-replicas", "2", "--port", str(port), "--ray-temp-dir", str(directory / "ray")]
    args += ["--ray-replica-cpus", str(REPLICA_CPUS), *serve_args]
    began = time.monotonic()
    proc = launch("kvfence serve --ray-replicas 2", args, env={"OMP_NUM_THREADS": "1", **tls})

    @functools.cache
    def ready() -> RayServer:
        proc.wait_for_http(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        print(f"  serving after {time.monotonic() - began:.1f} s (reported, not asserted)")
        cluster = _line(
            proc, r"started a local cluster at (\S+) \(authentication mode: (\w+); dashboard (\S+)\)"
        )
        token = Path(_line(proc, r"ray: token in (\S+) \(mode 0600").group(1))
        gcs, dashboard = cluster.group(1), cluster.group(3)
        url = f"http://127.0.0.1:{port}"
        keys_ = (api_key, other_key, admin_key, tier_key)
        return RayServer(proc, url, directory, serve_args, *keys_, gcs, dashboard, token, tls, tls_key)

    try:
        yield ready
    finally:
        clean_up(proc, directory)


def clean_up(proc: Proc, directory: Path) -> None:
    """Stop the server; kill by pid what its Ray session left (only if the stop left any: the test says
    so); remove the test's directory."""
    stop([proc])
    for pid in processes_under(directory):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(directory, ignore_errors=True)


def ray_state(server: RayServer) -> dict[str, Any]:
    probe = server.ray_python(STATE_PROBE, str(server.token_path))
    assert probe.returncode == 0, probe.stderr[-3000:]
    return dict(json.loads(probe.stdout.strip().splitlines()[-1]))


def replica_pids(server: RayServer) -> dict[str, int]:
    """Each live server replica's process, by replica id (Serve names a replica's actor after its id); the
    front is not one of them: it only forwards."""
    actors = ray_state(server)["actors"]
    return {
        a["name"].rsplit("#", 1)[1]: int(a["pid"])
        for a in actors
        if a["class_name"] == SERVER_ACTOR and a["state"] == "ALIVE"
    }
