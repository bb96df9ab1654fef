"""`kvfence serve --ray-replicas 2` on a real local Ray cluster (one machine, the real SmolLM2, 2 replicas of
half a CPU and one torch thread each): the same greedy answer as kvfence's own engine from both replicas, SSE
through Ray's proxy, kvfence's auth, Ray's token authentication on, and no API key or admin key anywhere in
Ray's state, its processes' environments or its session logs; then a clean stop with nothing left. And
`--ray-address` to a cluster without token authentication is refused before anything is deployed.

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
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvfence.disagg.launch import free_ports
from kvfence.harness.procs import Proc, launch, stop

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

# Small enough for two replicas and this test's own engine beside the rest of the suite on 2 cores.
ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "256", "--num-threads", "1", "--disable-log-stats"]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
START_TIMEOUT_S = 300.0
HTTP_TIMEOUT_S = 60.0
RAY_CLIENT_TIMEOUT_S = 90.0
SPREAD_TRIES = 24  # sequential requests until both replicas answered: all on one has odds 2 * 2^-24

# Run by a fresh interpreter with the token in its environment: Ray's state API and Serve's REST status as
# JSON on the last line of stdout (only JSON crosses back, nothing is unpickled here).
STATE_PROBE = """
import json, sys, httpx, ray
from ray.util.state import list_actors, list_jobs, list_placement_groups
context = ray.init(address=sys.argv[1], log_to_driver=False)
token = open(sys.argv[2]).read().strip()
serve = httpx.get(f"http://{context.dashboard_url}/api/serve/applications/",
                  headers={"authorization": f"Bearer {token}"}, timeout=30)
def rows(listed):
    return [json.loads(json.dumps(getattr(row, "__dict__", row), default=str)) for row in listed]
state = {"actors": rows(list_actors(detail=True)), "jobs": rows(list_jobs(detail=True)),
         "placement_groups": rows(list_placement_groups(detail=True)),
         "serve_status": serve.status_code, "serve": serve.text}
print(json.dumps(state))
"""
CONNECT_PROBE = "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); print('CONNECTED')"


@dataclass
class RayServer:
    proc: Proc
    url: str
    directory: Path  # this test's own: key files, the Ray session (ray/)
    api_key: str
    admin_key: str
    gcs: str
    dashboard: str
    token_path: Path

    def post(self, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response:
        headers = {"authorization": f"Bearer {key or self.api_key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)

    def ray_python(self, code: str, *args: str, token: bool = True) -> subprocess.CompletedProcess[str]:
        """`python -c CODE GCS ARGS` as a Ray client: with this cluster's token (by its file's path), or
        with no token anywhere Ray looks (no RAY_AUTH_* variable, a HOME without ~/.ray)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
        env |= {"HOME": str(self.directory / "home"), "RAY_USAGE_STATS_ENABLED": "0"}
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


def _processes_under(directory: Path) -> list[int]:
    """Live processes whose command line names `directory` (this test's Ray session: its raylet, GCS...)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            with contextlib.suppress(OSError):
                if str(directory).encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    pids.append(int(entry))
    return pids


@contextlib.contextmanager
def ray_server() -> Iterator[RayServer]:
    directory = Path(tempfile.mkdtemp(prefix="kvfr-"))
    (directory / "home").mkdir()
    api_key, admin_key = f"sk-{secrets.token_hex(16)}", f"admin-{secrets.token_hex(16)}"
    keys = _secret_file(directory / "api-keys", f"{api_key} tenant-a\n")
    admin = _secret_file(directory / "admin-key", f"{admin_key}\n")
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
    ]
    began = time.monotonic()
    proc = launch("kvfence serve --ray-replicas 2", args, env={"OMP_NUM_THREADS": "1"})
    try:
        proc.wait_for_http(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        print(f"  serving after {time.monotonic() - began:.1f} s (reported, not asserted)")
        cluster = _line(
            proc, r"started a local cluster at (\S+) \(authentication mode: (\w+); dashboard (\S+)\)"
        )
        token = Path(_line(proc, r"ray: token in (\S+) \(mode 0600").group(1))
        gcs, dashboard = cluster.group(1), cluster.group(3)
        yield RayServer(
            proc, f"http://127.0.0.1:{port}", directory, api_key, admin_key, gcs, dashboard, token
        )
    finally:
        clean_up(proc, directory)


def clean_up(proc: Proc, directory: Path) -> None:
    """Stop the server; kill by pid what its Ray session left (only if the stop left any: the test says
    so); remove the test's directory."""
    stop([proc])
    for pid in _processes_under(directory):
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
        check_no_secret_in_ray(server)
        proc, directory, token_path = server.proc, server.directory, server.token_path
        stop([proc])
        assert proc.popen.returncode == 0, proc.tail()
        assert not token_path.parent.exists(), "the token's directory outlived the server"
        assert _processes_under(directory) == [], "Ray processes outlived the server"


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


def check_no_secret_in_ray(server: RayServer) -> None:
    probe = server.ray_python(STATE_PROBE, str(server.token_path))
    assert probe.returncode == 0, probe.stderr[-3000:]
    state = json.loads(probe.stdout.strip().splitlines()[-1])
    replicas = [
        a for a in state["actors"] if a["class_name"].startswith("ServeReplica") and a["state"] == "ALIVE"
    ]
    names = sorted(a["class_name"] for a in replicas)  # two servers and kvfence's front
    assert names == ["ServeReplica:kvfence:kvfence"] * 2 + ["ServeReplica:kvfence:kvfence-front"], names
    assert state["serve_status"] == 200, state  # the probe sees the cluster
    dump = json.dumps(state)
    token = server.token_path.read_text().strip()
    secrets_ = {"API key": server.api_key, "admin key": server.admin_key, "Ray token": token}
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
        for pid in _processes_under(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)
