"""`kvfence serve --ray-replicas 2` on a real local Ray cluster (one machine, the real SmolLM2 on its exact
float32 path, 2 replicas of half a CPU and one torch thread each, one sealed Redis tier): the same greedy
answer as kvfence's own engine from both replicas, SSE through Ray's proxy, kvfence's auth, Ray's token
authentication on; the fleet (tests/integration/ray_fleet_checks.py): admin reads for every replica,
`kvfence audit` passing, a prefix restored across replicas for its tenant only, a replica killed mid-stream;
no API key, admin key or tier key anywhere in Ray's state, its processes' environments or its session
logs; then a clean stop with nothing left. And `--ray-address` to a cluster without token authentication
is refused before anything is deployed.

One test runs every check on the two-replica cluster: a module fixture split over pytest-xdist workers
would start a cluster in each of them, two on two cores. Each Ray session lives in a temporary directory
of its test's own (short: Ray's socket paths must fit 107 bytes); every process left with that directory
in its command line is killed by pid at the end, never by name.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from ray_fleet_checks import (
    check_audit_passes,
    check_fleet_views,
    check_ray_prometheus_export,
    check_replica_killed_mid_stream,
    check_shared_tier,
    processes_under,
)

from kvfence.disagg.launch import free_ports
from kvfence.harness.procs import Proc, launch, stop
from kvfence.harness.redis_server import redis_server

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

# Small enough for two replicas and this test's own engine beside the rest of the suite on 2 cores.
# The exact path: a prefix restored from the tier is a prefill in chunks, which moves the fast path's logits.
ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "256", "--num-threads", "1", "--disable-log-stats"]
ENGINE_ARGS += ["--activation-dtype", "float32"]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
RAY_CLIENT_TIMEOUT_S = 90.0
SERVER_ACTOR = "ServeReplica:kvfence:kvfence"  # a server replica's actor (the front's is kvfence-front)
SPREAD_TRIES = 24  # sequential requests until both replicas answered: all on one has odds 2 * 2^-24

# Run by a fresh interpreter with the token in its environment: Ray's state API and Serve's REST status as
# JSON on the last line of stdout (only JSON crosses back, nothing is unpickled here).
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
CONNECT_PROBE = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('CONNECTED')"


@dataclass
class RayServer:
    proc: Proc
    url: str
    directory: Path  # this test's own: key files, the Ray session (ray/)
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

    def ray_python(self, code: str, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        """`python -c CODE GCS ARGS` as a Ray client: with this cluster's token (by its file's path), or
        with no token anywhere Ray looks (no RAY_AUTH_* variable, a HOME without ~/.ray)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env |= {"HOME": str(self.directory / "home"), "RAY_USAGE_STATS_ENABLED": "0", **self.tls}
        if token:
            env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path)}
        command = [sys.executable, "-c", code, self.gcs, *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=RAY_CLIENT_TIMEOUT_S)


def _secret_file(path: Path, text: str) -> Path:
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
    key_path = _secret_file(directory / "tls.key", key)
    variables = {
        "RAY_USE_TLS": "1",
        "RAY_TLS_SERVER_CERT": str(cert_path),
        "RAY_TLS_SERVER_KEY": str(key_path),
    }
    return variables | {"RAY_TLS_CA_CERT": str(cert_path)}, key


@contextlib.contextmanager
def ray_server() -> Iterator[RayServer]:
    with contextlib.ExitStack() as stack:
        yield from _ray_server(stack)


def _ray_server(stack: contextlib.ExitStack) -> Iterator[RayServer]:
    directory = Path(tempfile.mkdtemp(prefix="kvfr-"))
    (directory / "home").mkdir()
    api_key, other_key = f"sk-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    admin_key, tier_key = f"admin-{secrets.token_hex(16)}", secrets.token_hex(32)
    keys = _secret_file(directory / "api-keys", f"{api_key} tenant-a\n{other_key} tenant-b\n")
    admin = _secret_file(directory / "admin-key", f"{admin_key}\n")
    tier = _secret_file(directory / "tier-key", f"{tier_key}\n")
    redis_directory = Path(tempfile.mkdtemp(prefix="kvfr-redis-"))  # not the Ray session's: outlives it
    stack.callback(shutil.rmtree, redis_directory, ignore_errors=True)
    redis = stack.enter_context(redis_server(redis_directory))
    tls, tls_key = _tls(directory)
    (port,) = free_ports(1)
    args = ["serve", "--ray-replicas", "2", "--port", str(port), "--ray-temp-dir", str(directory / "ray")]
    args += [
        "--ray-replica-cpus",
        "0.5",
        *ENGINE_ARGS,
        "--api-keys",
        str(keys),
        "--admin-key-file",
        str(admin),
        *("--kv-tier", redis.patient(), "--kv-tier-key-file", str(tier)),
    ]
    began = time.monotonic()
    proc = launch("kvfence serve --ray-replicas 2", args, env={"OMP_NUM_THREADS": "1", **tls})
    try:
        proc.wait_for_http(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        print(f"  serving after {time.monotonic() - began:.1f} s (reported, not asserted)")
        cluster = _line(
            proc, r"started a local cluster at (\S+) \(authentication mode: (\w+); dashboard (\S+)\)"
        )
        token = Path(_line(proc, r"ray: token in (\S+) \(mode 0600").group(1))
        gcs, dashboard = cluster.group(1), cluster.group(3)
        url = f"http://127.0.0.1:{port}"
        keys_ = (api_key, other_key, admin_key, tier_key)
        yield RayServer(proc, url, directory, *keys_, gcs, dashboard, token, tls, tls_key)
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


@pytest.fixture(scope="module")
def reference_text() -> str:
    """The greedy answer of kvfence's own engine in this process, built from the replicas' own options."""
    from kvfence.cli_options import engine_config
    from kvfence.engine.engine import load_engine
    from kvfence.ray.replica import parse_replica_args
    from kvfence.sampling import SamplingParams

    engine = load_engine(engine_config(parse_replica_args(ENGINE_ARGS)), log=lambda _: None)
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    return engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS))[0].output_text


def completion(server: RayServer) -> tuple[str, str]:
    """(the greedy completion's text, the replica that answered)."""
    body = {
        "model": "SmolLM2-135M-Instruct.Q4_1",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    response = server.post("/v1/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"], response.headers["x-kvfence-replica"]


@pytest.mark.timeout(600)
def test_two_replicas_on_ray(reference_text: str) -> None:
    with ray_server() as server:
        check_both_replicas_answer_as_the_engine(server, reference_text)
        check_streaming(server, reference_text)
        check_kvfence_auth(server)
        check_ray_token_auth(server)
        check_ray_tls(server)
        replicas = check_fleet_views(server, PROMPT)
        check_audit_passes(server)
        check_ray_prometheus_export(ray_state(server)["metrics_exports"], replicas)
        check_no_secret_in_ray(server)
        check_shared_tier(server, lambda: replica_pids(server))
        check_replica_killed_mid_stream(server, lambda: replica_pids(server))
        proc, directory, token_path = server.proc, server.directory, server.token_path
        stop([proc])
        assert proc.popen.returncode == 0, proc.tail()
        assert not token_path.parent.exists(), "the token's directory outlived the server"
        assert processes_under(directory) == [], "Ray processes outlived the server"


def check_both_replicas_answer_as_the_engine(server: RayServer, reference_text: str) -> None:
    answers: dict[str, set[str]] = {}
    for _ in range(SPREAD_TRIES):
        text, replica = completion(server)
        answers.setdefault(replica, set()).add(text)
        if len(answers) == 2:
            break
    assert len(answers) == 2, f"every request went to one replica: {answers}"
    assert all(texts == {reference_text} for texts in answers.values()), (answers, reference_text)
    print(f"  both replicas: {reference_text!r} ({', '.join(answers)})")


def check_streaming(server: RayServer, reference_text: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    headers = {"authorization": f"Bearer {server.api_key}"}
    pieces, events = [], []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    ) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/event-stream"
        )
        assert response.headers["x-kvfence-replica"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]" and len(events) > 2, events
    for event in events[:-1]:
        pieces.append(json.loads(event)["choices"][0]["text"])
    assert "".join(pieces) == reference_text


def check_kvfence_auth(server: RayServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1}
    for headers in ({}, {"authorization": "Bearer sk-not-a-key"}):
        response = httpx.post(
            f"{server.url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
        )
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
        assert isinstance(error["message"], str) and error["message"]
    tenant = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {server.api_key}"})
    admin = httpx.get(f"{server.url}/metrics", headers={"authorization": f"Bearer {server.admin_key}"})
    assert tenant.status_code in (401, 403) and admin.status_code == 200, (tenant.text, admin.status_code)


def check_ray_token_auth(server: RayServer) -> None:
    mode = httpx.get(f"http://{server.dashboard}/api/authentication_mode", timeout=HTTP_TIMEOUT_S)
    assert mode.json() == {"authentication_mode": "token"}
    assert httpx.get(f"http://{server.dashboard}/api/v0/actors", timeout=HTTP_TIMEOUT_S).status_code == 401
    assert server.token_path.stat().st_mode & 0o777 == 0o600
    refused = server.ray_python(CONNECT_PROBE, token=False)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "CONNECTED" not in refused.stdout, output[-2000:]
    assert "InvalidAuthToken" in output or "Unauthenticated" in output, output[-2000:]  # refused for that


def check_ray_tls(server: RayServer) -> None:
    """The GCS speaks TLS with this cluster's certificate, and only to a client with a certificate of its
    CA (Ray requires client certificates when RAY_TLS_CA_CERT is set)."""
    host, _, port = server.gcs.rpartition(":")
    cert = server.tls["RAY_TLS_SERVER_CERT"]
    for with_certificate in (True, False):
        context = ssl.create_default_context(cafile=cert)
        context.check_hostname = False  # Ray's certificate names the node's address as a DNS name
        context.set_alpn_protocols(["h2"])
        if with_certificate:
            context.load_cert_chain(cert, server.tls["RAY_TLS_SERVER_KEY"])
        with socket.create_connection((host, int(port)), timeout=HTTP_TIMEOUT_S) as raw:
            try:
                with context.wrap_socket(raw) as tls:
                    peer = tls.getpeercert(binary_form=True)
                    tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")  # gRPC's first bytes
                    first = tls.recv(9)  # HTTP/2's SETTINGS frame header, or nothing
            except (ssl.SSLError, ConnectionError) as exc:
                assert not with_certificate, f"a client with the CA's certificate was refused: {exc}"
                continue
        assert peer == ssl.PEM_cert_to_DER_cert(Path(cert).read_text())
        if with_certificate:
            assert len(first) == 9, f"the GCS did not answer gRPC's preface over TLS: {first!r}"
        else:
            assert first == b"", f"a client without a certificate was answered: {first!r}"


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


def check_no_secret_in_ray(server: RayServer) -> None:
    state = ray_state(server)
    replicas = [
        a for a in state["actors"] if a["class_name"].startswith("ServeReplica") and a["state"] == "ALIVE"
    ]
    names = sorted(a["class_name"] for a in replicas)  # two servers and kvfence's front
    assert names == [SERVER_ACTOR] * 2 + ["ServeReplica:kvfence:kvfence-front"], names
    assert state["serve_status"] == 200, state  # the probe sees the cluster
    dump = json.dumps(state)
    token = server.token_path.read_text().strip()
    secrets_ = {
        "API key": server.api_key,
        "second API key": server.other_key,
        "admin key": server.admin_key,
        "tier key": server.tier_key,
        "TLS key": "".join(server.tls_key.splitlines()[1:-1])[:64],  # the PEM's body, not its armour
        "Ray token": token,
    }
    for what, secret in secrets_.items():
        assert secret not in dump, f"the {what} is in Ray's state"
    for replica in replicas:  # the replicas' (and front's) environment: keys from files, the token by path
        environ = Path(f"/proc/{replica['pid']}/environ").read_bytes()
        for what, secret in secrets_.items():
            assert secret.encode() not in environ, f"the {what} is in a replica's environment"
        assert f"RAY_AUTH_TOKEN_PATH={server.token_path}".encode() in environ.split(b"\0")
    files = [p for p in (server.directory / "ray").rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.suffix in (".log", ".err", ".out") for p in files), "no Ray session logs found"
    for path in files:
        with contextlib.suppress(OSError):
            data = path.read_bytes()
            for what, secret in secrets_.items():
                assert secret.encode() not in data, f"the {what} is in {path}"
    print(f"  no secret in Ray's state ({len(state['actors'])} actors) or {len(files)} session files")


# A Ray cluster without token authentication, as someone else started it: the GCS address on stdout, up
# until stdin closes (then ray.shutdown stops its processes).
OPEN_CLUSTER = """
import sys, ray
context = ray.init(_temp_dir=sys.argv[1], num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=True)
print("GCS", context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_joining_a_cluster_without_token_auth_is_refused() -> None:
    """`--ray-address` to a cluster whose dashboard reports authentication mode `disabled`: one line, exit 2,
    before anything is deployed, though this side holds a token (Ray would connect with it)."""
    directory = Path(tempfile.mkdtemp(prefix="kvfj-"))
    (directory / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env |= {"HOME": str(directory / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
    head = subprocess.Popen(
        [sys.executable, "-c", OPEN_CLUSTER, str(directory / "ray")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env | {"RAY_AUTH_MODE": "disabled"},
    )
    try:
        assert head.stdout is not None
        first = head.stdout.readline()  # bounded by the test's timeout: the head prints it or exits
        assert first.startswith("GCS "), first
        token = _secret_file(directory / "token", secrets.token_hex(32))
        (port,) = free_ports(1)
        address = first.split()[1]
        command = [sys.executable, "-m", "kvfence", "serve", "--ray-replicas", "1", "--ray-address", address]
        joined = subprocess.run(
            [*command, "--port", str(port), *ENGINE_ARGS],
            env=env | {"RAY_AUTH_TOKEN_PATH": str(token), "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=RAY_CLIENT_TIMEOUT_S,
        )
        assert joined.returncode == 2, joined.stderr[-3000:]
        assert (
            "the cluster reports authentication mode 'disabled', not 'token'"
            in joined.stderr.splitlines()[-1]
        )
        assert "--insecure-ray" in joined.stderr.splitlines()[-1]
    finally:
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            head.communicate("", timeout=60)  # stdin closed: the head shuts its cluster down
        head.kill()
        for pid in processes_under(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
