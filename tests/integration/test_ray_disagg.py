"""`kvfence serve --disaggregated --ray` on a real local Ray cluster (one machine, 2 CPUs, the real SmolLM2):
the prefill and decode workers are Ray actors in one SPREAD placement group, the router is the command.
The answer equals kvfence's own engine's greedy text token for token and its trail shows the handoff (the
prefill's pages received on decode); no secret (API key, admin key, Ray token, any CURVE secret key) is in
Ray's state (actors, tasks, jobs, placement groups), the actors' environments or the session's files; a
decode actor killed (-9) mid-stream ends that stream with `decode_lost` after a prefix of the reference,
Ray restarts it and the next request is answered as before.

One cluster for the module (a fixture); each test is one check on it. The Ray session lives in a directory
of the module's own (short: Ray's socket paths must fit 107 bytes); every process left with that directory
in its command line is killed by pid at the end, never by name.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from kvfence.disagg.launch import free_ports
from kvfence.harness.key_files import write_key_file
from kvfence.harness.procs import Proc, launch, stop
from kvfence.harness.ray_state import RayCluster, processes_under, secrets_found, session_files
from kvfence.harness.server import audit_trail
from kvfence.harness.sse import iter_events

if TYPE_CHECKING:
    from kvfence.engine.engine import LLMEngine

pytest.importorskip("ray")
pytestmark = pytest.mark.real_model

ENGINE_ARGS = ["--num-pages", "64", "--max-model-len", "256", "--num-threads", "1", "--disable-log-stats"]
PROMPT = "The capital of France is"
MAX_TOKENS = 8
LONG_TOKENS = 96  # the stream decode is killed in: long enough to be mid-answer when the kill lands
START_TIMEOUT_S = 420.0  # a loaded 2-core box: two engines and their landing processes start at once
HTTP_TIMEOUT_S = 120.0
RESTART_TIMEOUT_S = 420.0  # a restarted actor reloads its engine and landing process (~200 s at load 25)
STOP_TIMEOUT_S = 120.0  # the actors' and the local cluster's stop after SIGTERM (over 20 s at load 25)
POLL_S = 0.5


@dataclass
class PdServer:
    proc: Proc
    url: str
    api_key: str
    admin_key: str
    cluster: RayCluster
    session: Path  # the Ray session's directory
    key_dir: Path  # the workers' CURVE keys, as the command wrote them

    def completion(self, max_tokens: int = MAX_TOKENS) -> httpx.Response:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        headers = {"authorization": f"Bearer {self.api_key}"}
        return httpx.post(f"{self.url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The worker actors alive now, by worker name (from the actor's repr)."""
        actors = self.cluster.state()["actors"]
        alive = [a for a in actors if a["class_name"] == "WorkerActor" and a["state"] == "ALIVE"]
        return {re.sub(r"^WorkerActor\((.*)\)$", r"\1", a.get("repr_name") or ""): a for a in alive}


@pytest.fixture(scope="module")
def server() -> Iterator[PdServer]:
    directory = Path(tempfile.mkdtemp(prefix="kvpd-"))
    (directory / "home").mkdir()
    api_key, admin_key = f"sk-{secrets.token_hex(16)}", f"admin-{secrets.token_hex(16)}"
    keys = write_key_file(directory / "api-keys", [f"{api_key} tenant-a"])
    admin = write_key_file(directory / "admin-key", [admin_key])
    (port,) = free_ports(1)
    args = [
        "serve",
        "--disaggregated",
        "--ray",
        "--port",
        str(port),
        "--ray-temp-dir",
        str(directory / "ray"),
    ]
    args += [*ENGINE_ARGS, "--api-keys", str(keys), "--admin-key-file", str(admin)]
    # TMPDIR: the command's own temporary directories (its key directory, Ray's token) are made in this
    # module's, so a server killed before its own clean-up leaves no key behind either
    env = {"OMP_NUM_THREADS": "1", "TMPDIR": str(directory)}
    proc = launch("kvfence serve --disaggregated --ray", args, env=env)
    try:
        proc.wait_for_http(f"http://127.0.0.1:{port}", START_TIMEOUT_S)
        cluster_line = r"started a local cluster at (\S+) \(authentication mode: token; dashboard (\S+)\)"
        gcs, dashboard = proc.first_match(cluster_line).groups()
        token = Path(proc.first_match(r"ray: token in (\S+) \(mode 0600").group(1))
        key_dir = Path(proc.first_match(r"workers placed \(SPREAD\), keys read from (\S+)").group(1))
        cluster = RayCluster(gcs, dashboard, token, directory / "home")
        for line in proc.log:  # which page transport each worker took (reported, not asserted)
            if "KV pages:" in line:
                print(f"  {line.strip()}")
        yield PdServer(
            proc, f"http://127.0.0.1:{port}", api_key, admin_key, cluster, directory / "ray", key_dir
        )
        stop([proc], STOP_TIMEOUT_S)
        assert proc.popen.returncode == 128 + signal.SIGTERM, proc.tail()  # the CLI's own SIGTERM exit
        assert not key_dir.exists() and not token.parent.exists(), "a key directory outlived the server"
        assert processes_under(directory) == [], "Ray processes outlived the server"
    finally:
        stop([proc])
        for pid in processes_under(directory):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(directory, ignore_errors=True)


@functools.cache
def _engine() -> LLMEngine:
    """kvfence's own engine in this process, with the workers' engine options."""
    from kvfence.cli_options import engine_config
    from kvfence.engine.engine import load_engine
    from kvfence.ray.replica import parse_replica_args

    return load_engine(engine_config(parse_replica_args(ENGINE_ARGS)), log=lambda _: None)


def _greedy(max_tokens: int, ignore_eos: bool = False) -> str:
    """The engine's greedy text for PROMPT."""
    from kvfence.sampling import SamplingParams

    engine = _engine()
    assert engine.tokenizer is not None
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos)
    return engine.generate([prompt], sampling)[0].output_text


@pytest.mark.timeout(600)
def test_pd_answer_equals_the_engine_and_the_trail_shows_the_handoff(server: PdServer) -> None:
    response = server.completion()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _greedy(MAX_TOKENS)
    events = audit_trail(server.url, server.admin_key, response.json()["id"])
    where = {(e["where"], e["kind"]) for e in events}
    handoff = {("router", "admitted"), ("prefill", "transfer_complete"), ("decode", "transfer_complete")}
    assert handoff | {("decode", "page_received"), ("decode", "finished")} <= where, where


@pytest.mark.timeout(600)
def test_workers_are_actors_of_one_spread_group_and_no_secret_is_in_ray(server: PdServer) -> None:
    state = server.cluster.state()
    workers = server.workers()
    assert sorted(workers) == ["decode", "prefill"], workers
    (group,) = [g for g in state["placement_group_table"].values() if g["state"] == "CREATED"]
    assert group["strategy"] == "SPREAD" and len(group["bundles"]) == 2, group
    assert {w["placement_group_id"] for w in workers.values()} == {group["placement_group_id"]}
    curve = {
        f"{path.stem}'s CURVE secret key": path.read_text().split()[1]
        for path in server.key_dir.glob("*.secret")
    }
    assert sorted(curve) == [f"{n}'s CURVE secret key" for n in ("decode", "prefill", "router")]
    token = server.cluster.token_path.read_text().strip()
    hidden = {"API key": server.api_key, "admin key": server.admin_key, "Ray token": token, **curve}
    assert any(p.suffix in (".log", ".err", ".out") for p in session_files(server.session))
    pids = [a["pid"] for a in state["actors"] if a["state"] == "ALIVE"]
    assert secrets_found(state, pids, server.session, hidden) == []
    # the search finds a secret where one is: the command's key directory holds each CURVE key
    assert len(secrets_found({}, [], server.key_dir, curve)) == len(curve)


@pytest.mark.timeout(600)
def test_decode_actor_killed_mid_stream_is_a_clean_error_then_restarted(server: PdServer) -> None:
    reference = _greedy(LONG_TOKENS, ignore_eos=True)
    before = server.workers()["decode"]
    body = {"prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {server.api_key}"}
    texts, errors = [], []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
    ) as response:
        assert response.status_code == 200
        for event in iter_events(response.iter_lines()):
            if "error" in event:
                errors.append(event["error"])
                continue
            texts.append(event["choices"][0]["text"])
            if len(texts) == 1:  # decode is answering: kill its actor's process now
                os.kill(before["pid"], signal.SIGKILL)
    assert [e.get("code") for e in errors] == ["decode_lost"], errors
    assert reference.startswith("".join(texts)) and len("".join(texts)) < len(reference), texts
    after = _wait_for_restart(server, before)
    assert after["pid"] != before["pid"] and after["num_restarts"] >= 1, after
    response = server.completion()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == _greedy(MAX_TOKENS)


def _wait_for_restart(server: PdServer, before: dict[str, Any]) -> dict[str, Any]:
    """The decode actor Ray restarted, once the router sees it up again (a bounded wait on states)."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        decode = server.workers().get("decode")
        health = httpx.get(f"{server.url}/health", timeout=HTTP_TIMEOUT_S)
        up = health.status_code == 200 and health.json().get("workers", {}).get("decode") == "up"
        if decode is not None and decode["pid"] != before["pid"] and up:
            return decode
        time.sleep(POLL_S)
    raise AssertionError(f"decode was not restarted within {RESTART_TIMEOUT_S:.0f}s")
