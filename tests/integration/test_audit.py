"""`kvfence audit` end to end: the acceptance checks against a healthy kvfence and against one with the
fence off and a fault armed (real model, in-process server on a free port), and the black-box probe
against tiny stand-in servers: one leaks an earlier tenant's prompt into later answers, one answers
differently under load (INCONCLUSIVE when it declares nothing, FAIL when it declares batch invariance).
(tests/integration/test_replay.py runs the replay check against kvfence with faults armed.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from conftest import real_engine, serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvfence.api.server import build_app
from kvfence.audit.cli import admin_key, run, tenant_keys
from kvfence.audit.client import ProbeClient, Target, check_test_address
from kvfence.audit.options import add_arguments
from kvfence.audit.pinned import check_pinned
from kvfence.audit.prefix_timing import probe_prefix_timing
from kvfence.engine.async_engine import AsyncEngine
from kvfence.harness.key_files import audit_key_args, write_key_file
from kvfence.model.gguf import GGUFModel
from kvfence.pins import file_sha256

ADMIN = "audit-admin"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
MODEL = "smollm2-audit"
SMALL = {"num_pages": 64, "max_model_len": 256}  # 1024-token pool, 256-token window: a fast boundary
PROBES = [
    *("boundary", "cancel_storm", "canary_scan", "replay", "recovery", "prefix_timing"),
    "status_consistency",
]
ACCEPTANCE = [
    "pinned_versions",
    "capacity",
    "rejection_terminates",
    "complete_handoff",
    "recycle_timing",
    "tenant_pages",
]


def audit(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    """`kvfence audit` with both tenants' keys; returns the exit status and the JSON report."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    report = out / "report.json"
    argv = ["--url", url, *audit_key_args(out, ["key-a", "key-b"]), "--json", str(report), *extra]
    status = run(parser.parse_args(argv))
    return status, json.loads(report.read_text(encoding="utf-8"))


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {check["name"]: check["status"] for check in report["checks"]}


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in report["checks"] if c["name"] == name)


# ---- against kvfence (real model) -------------------------------------------------------------------


@pytest.mark.real_model
def test_audit_passes_against_a_healthy_kvfence(smollm2: GGUFModel, tmp_path: Path) -> None:
    engine = AsyncEngine(real_engine(smollm2, **SMALL))
    page = tmp_path / "report.html"
    with serving(build_app(engine, MODEL, KEYS, ADMIN)) as url:
        status, report = audit(
            url,
            tmp_path,
            *audit_key_args(tmp_path, admin_key=ADMIN),
            "--html",
            str(page),
            "--server-flags",
            "x",
        )
    # prefix_timing's prompts are half this small window: a hit may not show (INCONCLUSIVE); never FAIL.
    timing = statuses(report)["prefix_timing"]
    assert timing in ("PASS", "INCONCLUSIVE")
    assert status == (0 if timing == "PASS" else 3), {
        c["name"]: c["details"] for c in report["checks"] if c["status"] != "PASS"
    }
    assert statuses(report) == dict.fromkeys(PROBES + ACCEPTANCE, "PASS") | {"prefix_timing": timing}
    assert report["boundary"]["accepted_total"] == SMALL["max_model_len"] and report["boundary"]["exact"]
    assert report["target"]["batch_invariant_declared"] is True
    replay = check(report, "replay")["evidence"][0]
    assert replay["compared"] >= 12 and replay["changed"] == 0, replay
    control = check(report, "canary_scan")["evidence"][0]["positive_control"]
    assert control["rate"] >= 0.9, control
    pins = check(report, "pinned_versions")["evidence"][-1]
    assert pins["source"] == "server: GET /v1/audit/info" and pins["startup_flags"] == "x"
    assert pins["pools"]["single"]["model_sha256"] == file_sha256(smollm2.path)
    html = page.read_text(encoding="utf-8")
    assert not re.search(r"<script|<link|<img|\b(?:src|href)\s*=|url\(|@import", html), "not self-contained"
    assert html.count("<svg") == len(report["trails"]) + 1  # one timeline per audited request + legend
    assert "<h3>replay</h3>" in html and "replay prompt 0 under load: SAME" in html


@pytest.mark.real_model
def test_audit_fails_complete_handoff_when_the_fence_is_off_and_a_fault_fires(
    smollm2: GGUFModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """read_beyond_written: a request believes its first pages hold its prompt (the incident's decode).
    Admission still refuses over-long prompts, but with the fence off the faulted requests answer 200 on
    unwritten KV: the handoff check names the fault that fired without an integrity abort."""
    faults = {"read_beyond_written": 1.0}
    engine = AsyncEngine(real_engine(smollm2, isolation=False, faults=faults, **SMALL))
    with serving(build_app(engine, MODEL, KEYS, ADMIN)) as url:
        admin = audit_key_args(tmp_path, admin_key=ADMIN)
        status, report = audit(url, tmp_path, *admin, "--expect-fault", "read_beyond_written")
    assert status == 1
    results = statuses(report)
    assert results["complete_handoff"] == "FAIL"
    assert (
        "fault read_beyond_written fired, yet the request ended answer"
        in check(report, "complete_handoff")["details"]
    )
    assert results["rejection_terminates"] == "PASS"  # rejections still fail closed: it is the handoff
    table = capsys.readouterr().out
    assert re.search(r"complete_handoff\s+FAIL", table) and "audit FAILED" in table


def server_info(**decode: Any) -> dict[str, Any]:
    """A disaggregated server's /v1/audit/info: two pools alike unless `decode` overrides a field."""
    transport = {"kind": "zeromq", "authenticated": True}
    pool = {"kvfence_version": "0.1.0", "git_commit": "abc", "model_sha256": "f" * 64, "page_size": 16}
    pool["transport"] = transport
    pools = {"prefill": pool, "decode": {**pool, **decode}}
    return {"mode": "disaggregated", "transport": transport, "pools": pools}


LANDING_CONDITIONS = ("landing_process", "separate_uid", "not_dumpable", "one_interface", "curve")


def nixl_transport(failing: str | None = None) -> dict[str, Any]:
    """A one-sided worker's transport as it reports it, every condition held but `failing`."""
    conditions = {name: name != failing for name in LANDING_CONDITIONS}
    sealed = all(conditions.values())
    return {
        "kind": "zeromq",
        "authenticated": True,
        "kv": "nixl",
        "data_plane_sealed": sealed,
        "conditions": conditions,
    }


@pytest.mark.parametrize(
    ("decode", "problem"),
    [
        ({}, None),
        ({"model_sha256": "e" * 64}, "pools report different model sha256s"),
        ({"model_sha256": None}, "model sha256 unknown"),
        ({"git_commit": "def"}, "pools report different git_commit values"),
        ({"transport": {"kind": "zeromq", "authenticated": False}}, "transport not authenticated"),
        (  # one-sided pages from an agent in the engine's own process: UCX reaches the pool
            {
                "transport": {
                    "kind": "zeromq",
                    "authenticated": True,
                    "kv": "nixl",
                    "data_plane_sealed": False,
                }
            },
            "data plane not sealed",
        ),
        (  # sealed, but saying nothing of how: not believed
            {"transport": {"kind": "zeromq", "authenticated": True, "kv": "nixl", "data_plane_sealed": True}},
            "data plane not sealed: conditions not reported",
        ),
        ({"transport": nixl_transport()}, None),
        *[
            ({"transport": nixl_transport(condition)}, f"data plane not sealed: {condition}")
            for condition in LANDING_CONDITIONS
        ],
    ],
)
def test_pinned_versions_from_the_server_need_one_known_model_and_code(
    decode: dict[str, Any], problem: str | None
) -> None:
    result = check_pinned(server_info(**decode), None, "m", None, {})
    assert result.status == ("PASS" if problem is None else "FAIL")
    assert problem is None or problem in str(result.details)


def test_pinned_versions_fail_when_the_server_serves_another_file(tmp_path: Path) -> None:
    expected = tmp_path / "expected.gguf"
    expected.write_bytes(b"the weights the auditor expects")
    served = server_info()
    assert check_pinned(served, expected, "m", None, {}).status == "FAIL"
    alike = {role: {**pool, "model_sha256": file_sha256(expected)} for role, pool in served["pools"].items()}
    assert check_pinned({**served, "pools": alike}, expected, "m", None, {}).status == "PASS"


# ---- black-box probe against stand-in servers -------------------------------------------------------

STAND_IN_WINDOW = 256  # words (one "token" per word)
STAND_IN_ADMIN = "stand-in-admin"


def stand_in(
    leaky: bool, load_sensitive: bool = False, declares: bool = False, gap: float | None = None
) -> Starlette:
    """A minimal OpenAI-compatible server. It counts words as tokens and refuses prompt + max_tokens
    beyond its window with a 400. The leaky one answers every request with the previous prompt another
    API key sent (as a recycled, unfenced KV page would); the clean one answers deterministically, except
    that a `load_sensitive` one answers otherwise while another request is in flight (as batch-dependent
    numerics, or another tenant's KV, would). `declares`: it pins batch invariance in its model card and
    at /v1/audit/info (admin key STAND_IN_ADMIN), and has no audit trails. `gap` set: it answers logprobs
    (when asked), scripted so that at every step the other answer's word trails the chosen one by `gap`
    nats; without it, no logprobs (the field is ignored)."""
    last_prompt: dict[str, str] = {}
    in_flight = [0]

    async def info(request: Request) -> Response:
        if request.headers.get("authorization") != f"Bearer {STAND_IN_ADMIN}":
            return JSONResponse({"error": {"message": "admin only"}}, status_code=403)
        return JSONResponse({"mode": "single", "pools": {"single": {"batch_invariant": True}}})

    async def models(_: Request) -> Response:
        card = {
            "id": "stand-in",
            "object": "model",
            "max_model_len": STAND_IN_WINDOW,
            "batch_invariant": declares,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def generate(request: Request, chat: bool) -> Response:
        body = await request.json()
        key = request.headers.get("authorization", "")
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        tokens, budget = len(prompt.split()), int(body.get("max_tokens") or 16)
        if tokens + budget > STAND_IN_WINDOW:
            return _context_error(tokens + budget)
        others = [p for k, p in last_prompt.items() if k != key]
        last_prompt[key] = prompt
        words = (others[-1].split() if leaky and others else [f"w{i}" for i in range(8)])[:budget]
        others_word = "busy"
        if load_sensitive:
            in_flight[0] += 1
            await asyncio.sleep(0.05)  # long enough for concurrent requests to overlap
            busy = in_flight[0] > 1
            words = [f"{'busy' if busy else 'w'}{i}" for i in range(8)][:budget]
            others_word = "w" if busy else "busy"
            in_flight[0] -= 1
        answer = _Answer(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", chat, words, tokens)
        if gap is not None and body.get("logprobs"):
            answer.script_logprobs([f"{others_word}{i}" for i in range(len(words))], gap)
        if body.get("stream"):
            return StreamingResponse(answer.events(), media_type="text/event-stream", headers=answer.headers)
        return JSONResponse(answer.body(), headers=answer.headers)

    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    routes = [
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    return Starlette(routes=[*routes, Route("/v1/audit/info", info)] if declares else routes)


def _context_error(asked: int) -> JSONResponse:
    message = (
        f"This model's maximum context length is {STAND_IN_WINDOW} tokens. "
        f"However, you requested {asked} tokens."
    )
    error = {
        "message": message,
        "type": "invalid_request_error",
        "param": None,
        "code": "context_length_exceeded",
    }
    return JSONResponse({"error": error}, status_code=400)


class _Answer:
    """One stand-in answer, as a whole body or as SSE chunks (a word per chunk, then the finish)."""

    def __init__(self, request_id: str, chat: bool, words: list[str], prompt_tokens: int) -> None:
        self.id, self.chat, self.words, self.prompt_tokens = request_id, chat, words, prompt_tokens
        self.headers = {"x-request-id": request_id}
        self.logprobs: dict[str, Any] | None = None

    def script_logprobs(self, runners_up: list[str], gap: float) -> None:
        """Every word at logprob -0.1, its runner-up at -0.1 - gap, in the endpoint's OpenAI shape."""
        tokens = [f" {w}" if i else w for i, w in enumerate(self.words)]
        seconds = [f" {w}" if i else w for i, w in enumerate(runners_up)]
        tops = [{t: -0.1, r: -0.1 - gap} for t, r in zip(tokens, seconds, strict=True)]
        if self.chat:
            content = [
                {
                    "token": t,
                    "logprob": -0.1,
                    "top_logprobs": [{"token": k, "logprob": v} for k, v in top.items()],
                }
                for t, top in zip(tokens, tops, strict=True)
            ]
            self.logprobs = {"content": content}
        else:
            self.logprobs = {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens), "top_logprobs": tops}

    def choice(self, text: str, finish: str | None) -> dict[str, Any]:
        if self.chat:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "finish_reason": finish}

    def body(self) -> dict[str, Any]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.words)}
        choice = self.choice(" ".join(self.words), "length") | {"logprobs": self.logprobs}
        return {"id": self.id, "choices": [choice], "usage": usage}

    async def events(self) -> AsyncIterator[str]:
        for i, word in enumerate(self.words):
            choice = self.choice(f" {word}" if i else word, None)
            if self.chat:
                choice["delta"] = choice.pop("message")
            yield f"data: {json.dumps({'id': self.id, 'choices': [choice]})}\n\n"
            await asyncio.sleep(0.02)
        done = self.choice("", "length")
        if self.chat:
            done["delta"] = done.pop("message")
        yield f"data: {json.dumps({'id': self.id, 'choices': [done]})}\n\n"
        yield "data: [DONE]\n\n"


def test_black_box_probe_catches_a_leaky_server(tmp_path: Path) -> None:
    with serving(stand_in(leaky=True)) as url:
        status, report = audit(url, tmp_path, "--black-box")
    assert status == 1
    results = statuses(report)
    assert results["canary_scan"] == "FAIL"
    assert "canary" in check(report, "canary_scan")["details"]
    assert results["boundary"] == "PASS" and results["status_consistency"] == "PASS"
    assert set(results) == set(PROBES), "--black-box runs the probes only"


def test_black_box_probe_passes_a_clean_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing fails; but a server that pins no batch invariance, and whose model does not copy its
    canaries, gets INCONCLUSIVE replay and canary scan, never PASS: exit status 3, not 0."""
    with serving(stand_in(leaky=False)) as url:
        status, report = audit(url, tmp_path, "--black-box")
    unsure = dict.fromkeys(["canary_scan", "replay", "prefix_timing"], "INCONCLUSIVE")  # it has no cache
    assert status == 3, {c["name"]: c["details"] for c in report["checks"] if c["status"] != "PASS"}
    assert statuses(report) == dict.fromkeys(PROBES, "PASS") | unsure
    assert report["inconclusive"] == ["canary_scan", "replay", "prefix_timing"]
    assert "positive control 0/" in check(report, "canary_scan")["details"]
    assert report["boundary"]["accepted_total"] == STAND_IN_WINDOW and report["boundary"]["exact"]
    assert "audit INCONCLUSIVE (not failed, not proven): canary_scan, replay, prefix_timing" in (
        capsys.readouterr().out
    )


def test_replay_is_inconclusive_against_a_server_that_declares_nothing(tmp_path: Path) -> None:
    """Answers that change under load, on a server without the pin: the change rate is reported, and the
    check neither passes nor fails."""
    with serving(stand_in(leaky=False, load_sensitive=True)) as url:
        status, report = audit(url, tmp_path, "--black-box")
    replay = check(report, "replay")
    assert replay["status"] == "INCONCLUSIVE" and status == 3
    summary = replay["evidence"][0]
    assert summary["declared_batch_invariant"] is False and summary["oracle"] == "none"
    assert summary["changed"] > 0 and summary["change_rate"] > 0, summary
    counted = f"{summary['changed']} of {summary['compared']} answers in batches and under load differ"
    assert counted in replay["details"]
    assert "does not declare batch invariance" in replay["details"]


@pytest.mark.parametrize(
    ("gap", "verdict"), [(0.001, "PASS"), (3.0, "FAIL")], ids=["near tie", "wide margin"]
)
def test_the_near_tie_oracle_explains_a_flip_at_a_near_tie_and_fails_one_at_a_wide_margin(
    tmp_path: Path, gap: float, verdict: str
) -> None:
    """The same undeclared, load-sensitive server, now answering logprobs: where its solo run chose each
    word over the one given under load by `gap` nats, a flip within the calibrated margin (floor 0.02:
    the stand-in's batched answers never agree long enough to measure jitter) is numerics, a flip the
    solo run was 3 nats sure against is not, and the check names the request and the step."""
    with serving(stand_in(leaky=False, load_sensitive=True, gap=gap)) as url:
        status, report = audit(url, tmp_path, "--black-box")
    replay = check(report, "replay")
    summary = replay["evidence"][0]
    assert summary["oracle"] == "near-tie" and summary["margin_nats"] == 0.02, summary
    assert summary["changed"] > 0 and replay["status"] == verdict, replay["details"]
    if verdict == "PASS":
        assert summary["explained"] == summary["changed"] and summary["beyond"] == 0
        assert "every change at a near-tie within the margin" in replay["details"]
    else:
        assert status == 1 and summary["beyond"] == summary["changed"]
        named = [item for item in replay["evidence"] if item.get("verdict") == "beyond"]
        assert named and named[0]["request_id"] in replay["details"]
        assert "step 0: 'busy0' where the solo run chose 'w0' by 3 nats" in replay["details"]


def test_replay_fails_a_server_that_declares_batch_invariance_and_changes(tmp_path: Path) -> None:
    """The same server pinning batch invariance: every changed answer fails the audit, named by its id,
    whether the pin is read from the model card (a tenant's view) or /v1/audit/info (the admin's)."""
    for admin in ([], audit_key_args(tmp_path, admin_key=STAND_IN_ADMIN)):
        with serving(stand_in(leaky=False, load_sensitive=True, declares=True)) as url:
            status, report = audit(url, tmp_path, "--black-box", *admin)
        assert report["target"]["batch_invariant_declared"] is True
        assert status == 1 and check(report, "replay")["status"] == "FAIL"
    replay = check(report, "replay")
    mismatches = [item for item in replay["evidence"] if "problem" in item]
    assert mismatches and mismatches[0]["request_id"] in replay["details"]
    assert all(m["text"].startswith("busy") and m["solo_text"].startswith("w0") for m in mismatches)


def test_probes_refuse_public_addresses_and_a_single_tenant(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a loopback or private"):
        check_test_address("http://8.8.8.8:8000")
    check_test_address("http://127.0.0.1:8000")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    (tmp_path / "two").mkdir()
    one, two = audit_key_args(tmp_path, ["k"]), audit_key_args(tmp_path / "two", ["a", "b"])
    assert run(parser.parse_args(["--url", "http://127.0.0.1:9", *one, "--black-box"])) == 2
    assert run(parser.parse_args(["--url", "http://8.8.8.8", *two, "--black-box"])) == 2


@pytest.mark.parametrize("flag", ["--api-key", "--admin-key"])
def test_the_audit_takes_no_key_on_its_command_line(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Every local user reads a command line: the old flags are refused, naming the file that replaces
    them, and the key is not repeated."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["--url", "http://127.0.0.1:9", flag, "sk-secret-123"])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and f"{flag}-file FILE" in error and "sk-secret-123" not in error


def test_the_audits_key_files_must_be_private_and_the_environment_is_a_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = audit_key_args(tmp_path, ["key-a", "key-b"])
    (tmp_path / "audit-api-keys").chmod(0o644)
    assert run(parser.parse_args(["--url", "http://127.0.0.1:9", *args, "--black-box"])) == 2
    assert "chmod 600" in capsys.readouterr().err
    assert tenant_keys(write_key_file(tmp_path / "k", ["# tenants", "key-a", "", "key-b  # b"])) == (
        "key-a",
        "key-b",
    )
    monkeypatch.setenv("KVFENCE_AUDIT_API_KEYS", "key-c key-d")
    monkeypatch.setenv("KVFENCE_ADMIN_KEY", "admin-e")
    assert (tenant_keys(None), admin_key(None)) == (("key-c", "key-d"), "admin-e")


@pytest.mark.real_model
@pytest.mark.parametrize(("tenant_b", "expected"), [("tenant-b", True), ("tenant-a", False)])
def test_prefix_timing_fails_when_two_keys_share_a_tenants_cache(
    smollm2: GGUFModel, tenant_b: str, expected: bool
) -> None:
    """Two keys of one tenant share its prefix cache (the leak a shared cache is across tenants): the
    second key's first token on the first key's prompt comes at a hit's speed, and the probe fails it;
    two tenants: computed, and it passes."""
    engine = AsyncEngine(real_engine(smollm2, max_model_len=1024, num_pages=128))
    keys = {"key-a": "tenant-a", "key-b": tenant_b}
    with serving(build_app(engine, MODEL, keys, ADMIN)) as url:
        client = ProbeClient(Target(url, tuple(keys), MODEL))
        try:
            result = probe_prefix_timing(client, 1024)
        finally:
            client.close()
    assert result.passed is expected, result.details
