"""Acceptance check 1, pinned_versions: the engine version, git commit, model file sha256, transport and
start-up flags that pin the audited service, recorded as evidence; the check fails when one is unknown or
the pools disagree.

Pins come from the server itself (`GET /v1/audit/info`: per pool the kvfence version and commit, the model
file's sha256, page size, pages, window, isolation); `--model-file` names the file the auditor expects it to
serve. Against a server without that endpoint they are computed client-side and labelled so: the auditor's
installed kvfence, the sha256 of `--model-file` (default: the packaged model), and `--page-size`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kvfence
from kvfence.audit.result import CheckResult, verdict
from kvfence.audit.trail import Trail
from kvfence.pins import file_sha256, git_commit, package_version


def default_model_file() -> Path | None:
    from kvfence.pins import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        return None


def check_pinned(
    server: dict[str, Any] | None,
    model_file: Path | None,
    served_model: str,
    flags: str | None,
    trails: dict[str, Trail],
) -> CheckResult:
    """Record what pins the service and fail when it is unknown or inconsistent.

    With the server's own report (`GET /v1/audit/info`) every pool must name the same code and a model
    sha256, the same for all pools, and equal to `model_file`'s when the auditor names the file it expects.
    Without one (an older server) the pins are the auditor's checkout and model file, labelled client-side."""
    if server is not None:
        return _pinned_by_server(server, model_file, served_model, flags)
    commit, dirty = git_commit(Path(kvfence.__file__).parent)
    path = model_file or default_model_file()
    sha = file_sha256(path) if path and path.is_file() else None
    disaggregated = any("where" in e for trail in trails.values() for e in trail)
    pins = {
        "engine_version": package_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "model_file": str(path) if path else None,
        "model_sha256": sha,
        "served_model": served_model,
        "served_model_matches_file": bool(path and path.stem == served_model),
        "transport": "ZeroMQ connector (disaggregated)" if disaggregated else "none (single node)",
        "startup_flags": flags,
        "source": "client-side: the server has no /v1/audit/info; the auditor's kvfence and model file",
    }
    problems = [
        {"problem": f"{name} unknown"} for name in ("engine_version", "model_sha256") if not pins[name]
    ]
    ok = (
        f"kvfence {pins['engine_version']} @ {_commit_label(commit, dirty)} "
        f"(client-side); model sha256 {str(sha)[:16]}…; transport {pins['transport']}; "
        f"flags: {flags or 'not given'}"
    )
    return _pinned_verdict(problems, ok, pins)


def _commit_label(commit: str | None, dirty: bool) -> str:
    return (commit or "no git")[:12] + (" (dirty)" if dirty else "")


def _pinned_verdict(problems: list[dict[str, Any]], ok: str, pins: dict[str, Any]) -> CheckResult:
    """The pinned_versions verdict, with what pins the service as its evidence."""
    result = verdict("pinned_versions", problems, ok, [])
    result.evidence.append(pins)
    return result


def _pinned_by_server(
    server: dict[str, Any], model_file: Path | None, served_model: str, flags: str | None
) -> CheckResult:
    pools: dict[str, dict[str, Any]] = server["pools"]
    problems: list[dict[str, Any]] = []
    for key, what in (("model_sha256", "model sha256"), ("kvfence_version", "engine version")):
        values = {role: pool.get(key) for role, pool in pools.items()}
        problems += [{"problem": f"{what} unknown", "pool": role} for role, v in values.items() if not v]
        if len(set(values.values())) > 1:
            problems.append({"problem": f"pools report different {what}s", "values": values})
    for key in ("git_commit", "page_size"):
        values = {role: pool.get(key) for role, pool in pools.items()}
        if len(set(values.values())) > 1:
            problems.append({"problem": f"pools report different {key} values", "values": values})
    problems += _transport_problems(server)
    expected = file_sha256(model_file) if model_file and model_file.is_file() else None
    first = next(iter(pools.values()))
    served = first.get("model_sha256")
    if expected and served and expected != served:
        problems.append({"problem": "the server's model is not the expected file", "expected": expected})
    pins = {
        **server,
        "served_model": served_model,
        "expected_model_sha256": expected,
        "startup_flags": flags,
        "source": "server: GET /v1/audit/info",
    }
    commit = _commit_label(first.get("git_commit"), bool(first.get("git_dirty")))
    expectation = "as expected" if expected else "no expected file given"
    ok = (
        f"kvfence {first.get('kvfence_version')} @ {commit}; model sha256 {str(served)[:16]}… "
        f"({expectation}); {server['mode']}, {len(pools)} pool(s); flags: {flags or 'not given'}"
    )
    return _pinned_verdict(problems, ok, pins)


def _transport_problems(server: dict[str, Any]) -> list[dict[str, Any]]:
    """A disaggregated service whose router or workers accept unauthenticated frames: any process that
    reaches a port could act as any tenant (`--insecure-transport`, or keys left off on loopback)."""
    transports = {"router": server.get("transport")} if server.get("mode") == "disaggregated" else {}
    transports |= {
        role: pool.get("transport") for role, pool in server["pools"].items() if "transport" in pool
    }
    problems = [
        {"problem": "transport not authenticated", "where": where, "transport": transport}
        for where, transport in transports.items()
        if not (isinstance(transport, dict) and transport.get("authenticated"))
    ]
    # A worker that moves pages one-sided must say its data plane is sealed: pages under AEAD, the fabric's
    # agent in a landing process holding no pool, under a uid of its own, not dumpable, UCX on one
    # interface, CURVE on the control channel (UCX authenticates nobody). Each condition that does not
    # hold fails by name; a worker that reports none fails as a whole.
    for where, transport in transports.items():
        if not isinstance(transport, dict) or transport.get("kv") != "nixl":
            continue
        conditions = transport.get("conditions")
        failed = (
            [name for name, held in conditions.items() if not held]
            if isinstance(conditions, dict) and conditions
            else ["conditions not reported"]
        )
        if failed or not transport.get("data_plane_sealed"):
            problems += [
                {"problem": f"data plane not sealed: {name}", "where": where, "transport": transport}
                for name in failed or ["data_plane_sealed is false"]
            ]
    return problems
