"""The fleet checks of tests/integration/test_ray_serve.py's two-replica cluster (one cluster for all: each
start costs a minute on two cores): the admin reads answer for every replica, `kvfence audit` passes
against the Ray endpoint, a tenant's prefix computed on one replica is restored from the shared sealed
Redis tier on the other (for that tenant only), and a replica killed mid-stream cuts its stream (never a
wrong answer) while the other answers and Ray replaces it.

Every wait here waits for a state (a replica answering, a counter reaching a value), bounded by a hang
guard; nothing is timed. Which replica Ray's router picks is chance: a check sends until the replica it
needs answered, at most SPREAD_TRIES times (all on one replica: odds 2^-24).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import httpx
from prometheus_client.parser import text_string_to_metric_families

HTTP_TIMEOUT_S = 60.0
SPREAD_TRIES = 24
WAIT_S = 240.0  # hang guard on states the cluster must reach (a stored page, a replacement replica)
TIER_PROMPT = " ".join(f"Clause {i}: the tenant's ledger entry {i * 7 % 31} is settled." for i in range(13))
TIER_PAGES = 8  # full pages of TIER_PROMPT (about 190 tokens, 16 a page) that must come from the tier
STORES = "kvfence_kv_tier_stores_total"
KILL_TRIES = 5  # streams until one is cut mid-way (a stream that finished before the stop is no test)
AUDIT_TIMEOUT_S = 600.0


class Server(Protocol):
    url: str
    api_key: str
    other_key: str
    admin_key: str
    directory: Path

    def post(self, path: str, body: dict[str, object], key: str | None = None) -> httpx.Response: ...


def admin_get(server: Server, path: str) -> httpx.Response:
    headers = {"authorization": f"Bearer {server.admin_key}"}
    return httpx.get(f"{server.url}{path}", headers=headers, timeout=HTTP_TIMEOUT_S)


def samples(server: Server, name: str) -> list[tuple[dict[str, str], float]]:
    response = admin_get(server, "/metrics")
    assert response.status_code == 200, response.text
    families = text_string_to_metric_families(response.text)
    return [(s.labels, s.value) for f in families for s in f.samples if s.name == name]


def replica_metric(server: Server, name: str, replica: str, **labels: str) -> float:
    wanted = {"replica": replica, **labels}.items()
    return sum(value for got, value in samples(server, name) if wanted <= got.items())


def complete(
    server: Server, prompt: str, key: str, max_tokens: int = 8, ignore_eos: bool = False
) -> tuple[str, str, str]:
    """(text, request id, the replica that answered) of a greedy completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": ignore_eos}
    response = server.post("/v1/completions", body, key)
    assert response.status_code == 200, response.text
    data = response.json()
    return data["choices"][0]["text"], data["id"], response.headers["x-kvfence-replica"]


def until(what: str, attempt: Callable[[], Any]) -> Any:
    """`attempt()` until it returns something true, up to SPREAD_TRIES times."""
    for _ in range(SPREAD_TRIES):
        if result := attempt():
            return result
    raise AssertionError(f"{what}: not in {SPREAD_TRIES} tries")


def wait_for(what: str, state: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (result := state()):
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s (a hang guard)"
        time.sleep(0.5)
    return result


def trail(server: Server, request_id: str) -> tuple[dict[str, Any], str]:
    """The fleet's trail of `request_id` and the replica that answered the lookup."""
    response = admin_get(server, f"/v1/audit/requests/{request_id}")
    assert response.status_code == 200, response.text
    return response.json(), response.headers["x-kvfence-replica"]


def fleet_replicas(server: Server) -> list[str]:
    response = admin_get(server, "/v1/audit/info")
    assert response.status_code == 200, response.text
    info = response.json()
    assert sorted(info["pools"]) == sorted(f"{r}/single" for r in info["replicas"]), info["pools"]
    return sorted(info["replicas"])


# ---- the admin reads, the fleet's -------------------------------------------------------------------


def check_fleet_views(server: Server, prompt: str) -> list[str]:
    """/v1/audit/info lists both replicas' pools, a trail is found whichever replica the lookup reaches,
    and /metrics holds both replicas' series, labelled; the two replica ids."""
    replicas = fleet_replicas(server)
    assert len(replicas) == 2, replicas
    _, request_id, owner = complete(server, prompt, server.api_key)

    def looked_up_elsewhere() -> dict[str, Any] | None:
        found, by = trail(server, request_id)
        return found if by != owner else None

    found = until("a trail lookup reaching the other replica", looked_up_elsewhere)
    assert found["replicas"] == [owner] and {e["where"] for e in found["events"]} == {owner}
    kinds = [e["kind"] for e in found["events"]]
    assert kinds[0] == "admitted" and "finished" in kinds, kinds
    pages = samples(server, "kvfence_pages")
    assert {labels["replica"] for labels, _ in pages} == set(replicas), pages
    assert admin_get(server, "/v1/audit/requests/cmpl-nobody").status_code == 404
    tenant = httpx.get(
        f"{server.url}/v1/audit/info",
        headers={"authorization": f"Bearer {server.api_key}"},
        timeout=HTTP_TIMEOUT_S,
    )
    assert tenant.status_code in (401, 403), tenant.text
    print(f"  fleet views: {replicas}, trail of {owner}'s request found from the other")
    return replicas


def check_audit_passes(server: Server) -> None:
    """`kvfence audit` against the Ray endpoint: every acceptance check passes. prefix_timing, a timing
    probe, may be INCONCLUSIVE (a tenant's repeat routed to the other replica shows no cache hit: nothing
    to tell apart), never FAIL."""
    keys = server.directory / "audit-keys"
    fd = os.open(keys, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(f"{server.api_key}\n{server.other_key}\n")
    report = server.directory / "audit.json"
    command = [sys.executable, "-m", "kvfence", "audit", "--url", server.url, "--api-key-file", str(keys)]
    command += ["--admin-key-file", str(server.directory / "admin-key"), "--json", str(report)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=AUDIT_TIMEOUT_S)
    assert done.returncode in (0, 3), done.stdout[-4000:] + done.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(report.read_text())["checks"]}
    acceptance = ["pinned_versions", "capacity", "rejection_terminates", "complete_handoff"]
    for name in [*acceptance, "recycle_timing", "tenant_pages", "canary_scan", "boundary"]:
        assert checks[name]["passed"] is True, checks[name]
    unproven = sorted(n for n, c in checks.items() if c["passed"] is not True)
    assert set(unproven) <= {"prefix_timing"}, {n: checks[n] for n in unproven}
    assert checks["prefix_timing"]["passed"] in (True, None), checks["prefix_timing"]
    print(f"  kvfence audit: exit {done.returncode}, not proven: {unproven or 'none'}")


def check_ray_prometheus_export(exports: list[str], replicas: list[str]) -> None:
    """Ray's own Prometheus export (each node's metrics agent) carries every replica's kvfence series,
    `ray_` prefixed and labelled by replica: the pool's pages of each, as /metrics counts them."""

    def exported() -> dict[str, float] | None:
        pages: dict[str, float] = {}
        for address in exports:
            text = httpx.get(f"http://{address}/metrics", timeout=HTTP_TIMEOUT_S).text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "ray_kvfence_pages" and sample.labels.get("deployment") == "kvfence":
                        replica = sample.labels["replica"]
                        pages[replica] = pages.get(replica, 0.0) + sample.value
        return pages if sorted(pages) == replicas else None

    pages = wait_for("both replicas' series in Ray's Prometheus export", exported)
    assert all(total == 64 for total in pages.values()), pages  # --num-pages 64 each
    print(f"  Ray's Prometheus export: ray_kvfence_pages of {sorted(pages)}")


# ---- the shared sealed tier -------------------------------------------------------------------------


def check_shared_tier(server: Server, pids_of: Callable[[], dict[str, int]]) -> None:
    """Tenant a's prefix computed on one replica comes back from Redis on another, the cold answer token
    for token; tenant b gets nothing of it from the tier (computes its own). The tenant router keeps a's
    prompt on the replica that computed it, so that replica is killed (-9) once its pages are stored: the
    survivor and Ray's replacement never computed the prompt, and whichever answers it must restore it.
    The stores counted are the prompt's own (the counter's value before it is subtracted: earlier checks
    stored pages too).
    `pids_of()`: each replica's process id, by replica id."""
    stored = {r: replica_metric(server, STORES, r, tier="redis") for r in fleet_replicas(server)}
    cold, first_id, first = complete(server, TIER_PROMPT, server.api_key)
    stores = lambda: replica_metric(server, STORES, first, tier="redis") - stored[first]  # noqa: E731
    wait_for(f"replica {first} storing the prompt's pages", lambda: stores() >= TIER_PAGES)
    assert not [e for e in trail(server, first_id)[0]["events"] if e["kind"] == "tier_restored"]
    os.kill(pids_of()[first], signal.SIGKILL)
    replicas = _replaced(server, first)
    before = {r: replica_metric(server, "kvfence_kv_tier_hits_total", r, tier="redis") for r in replicas}
    text, restored_id, other = complete(server, TIER_PROMPT, server.api_key)
    assert text == cold and other != first
    restored = [e for e in trail(server, restored_id)[0]["events"] if e["kind"] == "tier_restored"]
    assert restored and sum(len(e["pages"]) for e in restored) >= TIER_PAGES, restored
    hits = replica_metric(server, "kvfence_kv_tier_hits_total", other, tier="redis") - before[other]
    assert hits >= TIER_PAGES, hits
    before = {r: replica_metric(server, "kvfence_kv_tier_hits_total", r, tier="redis") for r in replicas}
    text_b, b_id, _ = complete(server, TIER_PROMPT, server.other_key)
    assert text_b == cold
    kinds = {e["kind"] for e in trail(server, b_id)[0]["events"]}
    assert not kinds & {"tier_restored", "prefix_hit"}, kinds
    after = {r: replica_metric(server, "kvfence_kv_tier_hits_total", r, tier="redis") for r in replicas}
    assert after == before, (before, after)
    print(f"  shared tier: {first} stored (then killed), {other} restored {hits:.0f} pages for a; none for b")


# ---- a replica killed --------------------------------------------------------------------------------


def check_replica_killed_mid_stream(server: Server, pids_of: Callable[[], dict[str, int]]) -> None:
    """kill -9 the replica serving a stream after its first token (SIGSTOP first, so it generates no more):
    the client's stream ends cut, without [DONE], and what it got is the start of the greedy answer; the
    other replica answers meanwhile; Ray replaces the killed one, which then answers as the others do.
    `pids_of()`: each replica's process id, by replica id (Ray's state API)."""
    prompt, tokens = "Once upon a time", 64  # long enough to be cut: the stop comes after its first token
    killed, texts, survivor = _cut_stream(server, pids_of, prompt, tokens)
    full, _, by = complete(server, prompt, server.api_key, max_tokens=tokens, ignore_eos=True)
    assert by == survivor and full.startswith("".join(texts)) and len(full) > len("".join(texts))
    for _ in range(4):  # the survivor answers everything meanwhile
        assert complete(server, prompt, server.api_key, max_tokens=tokens, ignore_eos=True)[0] == full
    fleet = _replaced(server, killed)
    (new,) = [r for r in fleet if r != survivor]
    text = until(f"the new replica {new} answering", lambda: _answer_from(server, prompt, tokens, new))
    assert text == full
    for replica in fleet:  # nothing of the cut stream is held: every pool drains
        wait_for(f"replica {replica}'s pool drained", lambda r=replica: _drained(server, r))
    print(f"  killed {killed} mid-stream ({len(texts)} pieces, cut); {survivor} answered; {new} replaced it")


def _replaced(server: Server, killed: str) -> list[str]:
    return wait_for(
        "Ray replacing the killed replica",
        lambda: r if len(r := fleet_replicas(server)) == 2 and killed not in r else None,
    )


def _cut_stream(
    server: Server, pids_of: Callable[[], dict[str, int]], prompt: str, tokens: int
) -> tuple[str, list[str], str]:
    """(the replica killed, the pieces its client got, the other replica). A stream whose every token was
    sent before the stop (its [DONE] came) proves nothing: once the fleet is whole again, another."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {server.api_key}"}
    for _ in range(KILL_TRIES):
        pids = pids_of()
        texts, done, replica = [], False, ""
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=HTTP_TIMEOUT_S
            ) as response:
                replica = response.headers["x-kvfence-replica"]
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[len("data: ") :])
                        texts += [c["text"] for c in event.get("choices", [])]
                        if len(texts) == 1:
                            os.kill(pids[replica], signal.SIGSTOP)  # no token more, then gone
                            os.kill(pids[replica], signal.SIGKILL)
        except httpx.HTTPError as exc:  # the stream cut: what a client of a dead replica must see
            print(f"  the stream of {replica} ended: {type(exc).__name__}")
        (other,) = [r for r in pids if r != replica]
        if not done:
            return replica, texts, other
        _replaced(server, replica)
    raise AssertionError(f"no stream cut in {KILL_TRIES} tries")


def _answer_from(server: Server, prompt: str, tokens: int, replica: str) -> str | None:
    text, _, by = complete(server, prompt, server.api_key, max_tokens=tokens, ignore_eos=True)
    return text if by == replica else None


def _drained(server: Server, replica: str) -> bool:
    """Every page of the replica's pool takeable again (free, or an idle prefix page) and none quarantined."""
    pages = _of(replica, samples(server, "kvfence_pages"))
    total = sum(value for _, value in pages)
    quarantined = sum(value for labels, value in pages if labels["state"] == "quarantined")
    takeable = sum(value for _, value in _of(replica, samples(server, "kvfence_pages_free")))
    return total > 0 and takeable == total and quarantined == 0


def _of(replica: str, found: list[tuple[dict[str, str], float]]) -> list[tuple[dict[str, str], float]]:
    return [(labels, value) for labels, value in found if labels["replica"] == replica]
