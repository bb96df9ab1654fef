"""`kvfence serve --ray-replicas 2` on a real local Ray cluster (tests/integration/ray_cluster.py: the real
SmolLM2, 2 replicas, one sealed Redis tier, Ray's token authentication and TLS), one cluster for every
check, each test function a few of them, in this order: the same greedy answer as kvfence's own engine from
both replicas, SSE through Ray's proxy; kvfence's auth and Ray's; Ray's TLS; the fleet
(tests/integration/ray_fleet_checks.py): admin reads for every replica and Ray's Prometheus export,
`kvfence audit` passing; no API key, admin key, tier key, TLS key or token anywhere in Ray's state, its
processes' environments or its session logs; a tenant's next turn on the replica holding its prefix, no
steering for another tenant; a prefix restored across replicas for its tenant only, a replica killed
mid-stream; autoscaling from Serve's config (tests/integration/ray_scaling_checks.py); then a clean stop
with nothing left. And `--ray-address` to a cluster without token authentication is refused before
anything is deployed (a cluster of its own, run while the shared one boots).

Under pytest-xdist one worker runs them all, in order, on the one cluster its module fixture starts
(tests/conftest.py: ONE_WORKER_MODULES; a fixture split over workers would start a cluster in each, two
on two cores). A test later in the order relies only on the fleet being whole
again (every wait for Ray's replacement is inside the test that killed), so any one of them also runs alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from ray_cluster import (
    ENGINE_ARGS,
    HTTP_TIMEOUT_S,
    RAY_CLIENT_TIMEOUT_S,
    SERVER_ACTOR,
    RayServer,
    ray_server,
    ray_state,
    replica_pids,
    secret_file,
)
from ray_fleet_checks import (
    check_audit_passes,
    check_fleet_views,
    check_ray_prometheus_export,
    check_replica_killed_mid_stream,
    check_shared_tier,
)
from ray_scaling_checks import check_autoscaling

from kvfence.disagg.launch import free_ports
from kvfence.harness.procs import stop
from kvfence.harness.ray_state import processes_under

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

PROMPT = "The capital of France is"
MAX_TOKENS = 8
SPREAD_TRIES = 24  # sequential requests until both replicas answered: all on one has odds 2 * 2^-24
AFFINITY_TRIALS = 14  # always on tenant a's replica: odds 2^-14 under power-of-two choices
FILLER = "Please keep the answer short and plain, one sentence, no lists, no markdown at all. "  # 2 chunks
CONNECT_PROBE = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('CONNECTED')"


@pytest.fixture(scope="module")
def booting() -> Iterator[Callable[[], RayServer]]:
    """The shared cluster, launched; calling it waits until it serves."""
    with ray_server() as ready:
        yield ready


@pytest.fixture(scope="module")
def server(booting: Callable[[], RayServer]) -> RayServer:
    return booting()


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


# A Ray cluster without token authentication, as someone else started it: the GCS address on stdout, up
# until stdin closes (then ray.shutdown stops its processes).
OPEN_CLUSTER = """
import sys, ray
context = ray.init(_temp_dir=sys.argv[1], num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=True)
print("GCS", context.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.mark.usefixtures("booting")  # the shared cluster boots meanwhile: its start is mostly waiting
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
        token = secret_file(directory / "token", secrets.token_hex(32))
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


def test_both_replicas_answer_as_the_engine(server: RayServer, reference_text: str) -> None:
    check_both_replicas_answer_as_the_engine(server, reference_text)
    check_streaming(server, reference_text)


def test_kvfence_auth_and_ray_token_auth(server: RayServer) -> None:
    check_kvfence_auth(server)
    check_ray_token_auth(server)


def test_ray_tls(server: RayServer) -> None:
    check_ray_tls(server)


def test_fleet_views_and_ray_prometheus_export(server: RayServer) -> None:
    replicas = check_fleet_views(server, PROMPT)
    check_ray_prometheus_export(ray_state(server)["metrics_exports"], replicas)


def test_kvfence_audit_passes_against_ray(server: RayServer) -> None:
    check_audit_passes(server)


def test_no_secret_in_ray(server: RayServer) -> None:
    check_no_secret_in_ray(server)


def test_a_tenants_prefix_sticks_and_steers_nobody_else(server: RayServer) -> None:
    check_tenant_affinity(server)


def test_shared_tier_restores_for_its_tenant_on_another_replica(server: RayServer) -> None:
    check_shared_tier(server, lambda: replica_pids(server))


def test_replica_killed_mid_stream(server: RayServer) -> None:
    check_replica_killed_mid_stream(server, lambda: replica_pids(server))


def test_autoscaling_from_one_server_to_two_under_load_and_back(server: RayServer) -> None:
    check_autoscaling(server)


def test_a_clean_stop_leaves_nothing(server: RayServer) -> None:
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


def check_tenant_affinity(server: RayServer) -> None:
    """kvfence's tenant router: a tenant's next chat turn lands on the replica that took its previous turn
    (its pool holds that prefix), every time; another tenant's identical first turn is placed by load
    balancing, not by the first tenant's placement: over AFFINITY_TRIALS fresh prompts it lands elsewhere at
    least once (what a tenant-blind affinity would never do)."""
    placements = []
    for trial in range(AFFINITY_TRIALS):
        turn1 = [{"role": "user", "content": f"Question {trial}. {FILLER}What is {trial} plus {trial}?"}]
        first = _chat(server, server.api_key, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": "It is"}, {"role": "user", "content": "Why?"}]
        assert _chat(server, server.api_key, turn2) == first, f"trial {trial}: tenant-a's next turn moved"
        placements.append((first, _chat(server, server.other_key, turn1)))
    assert any(b != a for a, b in placements), f"tenant-b always followed tenant-a: {placements}"
    assert len({a for a, _ in placements}) == 2, f"tenant-a's first turns all on one replica: {placements}"
    print(f"  tenant-b elsewhere in {sum(b != a for a, b in placements)} of {AFFINITY_TRIALS} trials")


def _chat(server: RayServer, key: str, messages: list[dict[str, str]]) -> str:
    """The replica that answered one greedy two-token chat turn."""
    response = server.post(
        "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "temperature": 0}, key
    )
    assert response.status_code == 200, response.text
    return response.headers["x-kvfence-replica"]
