"""Prefill and decode as real processes over ZeroMQ behind the router's OpenAI API, on the real model.

Includes the incident end to end: a prefill pool smaller than the context window, tenant A's secret in
the decode pool, tenant B's over-long prompt. Isolation off with `placeholder_transfer` armed: B's decode
reads A's stale pages. Isolation on: B gets a 400 before anything is reserved anywhere.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
from conftest import real_engine

from kvfence.config import EngineConfig
from kvfence.disagg.nixl_transport import nixl_available
from kvfence.grammar.compiler import GrammarCompiler
from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.references import EXACT
from kvfence.harness.server import metric
from kvfence.harness.workers import Spawned
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path, file_sha256
from kvfence.sampling import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

ADMIN = "admin-key"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
MODEL = default_model_path().stem
# The incident's shape, scaled down: prefill holds 512 tokens, the advertised window is 1024.
# The exact path: completions and logprobs are compared with an in-process engine (`real_engine`).
PREFILL = EngineConfig(num_pages=32, max_model_len=512, num_threads=1, activation_dtype=EXACT)
DECODE = replace(PREFILL, num_pages=68, max_model_len=1024, trace_pages=True, enable_prefix_caching=False)
SECRET = (
    "Internal memo for tenant A only. The vault access code is 4471-ALPHA-RIVER and the launch date "
    "of project Heron is the ninth of March. "
)


# B's prompt: about 770 tokens, more than the prefill pool holds, less than the advertised window.
LONG_PROMPT = "Summarise this log line by line. " + " ".join(f"entry {i} ok;" for i in range(120))


def disaggregated(
    isolation: bool, prefill_faults: dict[str, float] | None = None
) -> AbstractContextManager[Cluster]:
    """Prefill and decode worker processes, the router and its HTTP server here; both workers and the
    router with the same isolation."""
    return cluster(
        prefill=Spawned(replace(PREFILL, isolation=isolation, faults=prefill_faults or {})),
        decode=Spawned(replace(DECODE, isolation=isolation)),
        api_keys=KEYS,
        admin_key=ADMIN,
        model_name=MODEL,
        isolation=isolation,
    )


def client(cluster: Cluster, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key=key, max_retries=0)


@pytest.fixture(scope="module")
def fenced() -> Iterator[Cluster]:
    with disaggregated(isolation=True) as running:
        yield running


def chat_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_disaggregated_answer_equals_single_node(fenced: Cluster, smollm2: GGUFModel) -> None:
    question = "What is the capital of France? Answer in one sentence."
    reply = client(fenced, "key-a").chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=24, temperature=0
    )
    engine = real_engine(smollm2)
    assert engine.tokenizer is not None
    expected = engine.generate([chat_ids(engine.tokenizer, question)], SamplingParams(max_tokens=24))[0]
    assert reply.choices[0].message.content == expected.output_text
    events = fenced.audit(reply.id)
    where = {(e["where"], e["kind"]) for e in events}
    assert {
        ("router", "admitted"),
        ("prefill", "transfer_complete"),
        ("decode", "transfer_complete"),
        ("decode", "finished"),
    } <= where
    assert any(e["kind"] == "page_received" for e in events)


def test_streaming_through_the_router(fenced: Cluster) -> None:
    b = client(fenced, "key-b")
    messages = [{"role": "user", "content": "Name three colors."}]
    full = b.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    chunks = b.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == full.choices[0].message.content
    )


def test_logprobs_through_the_router_are_decodes_own(fenced: Cluster, smollm2: GGUFModel) -> None:
    """Decode samples every token and sends each one's logprob and top entries with it: the router's answer
    carries the single node's tokens and logprobs. Prompt logprobs are prefill's, which reports none: a
    400 naming them, never an answer without them."""
    question = "Name a color."
    reply = client(fenced, "key-a").chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": question}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    engine = real_engine(smollm2)
    assert engine.tokenizer is not None
    request = engine.add_request(
        chat_ids(engine.tokenizer, question), SamplingParams(max_tokens=6, logprobs=3)
    )
    expected = []
    while not request.is_finished:
        expected += [
            entry
            for out in engine.step()
            if out.request_id == request.request_id
            for entry in out.logprobs or []
        ]
    content = reply.choices[0].logprobs.content
    assert len(content) == len(expected) == 6
    assert [got.token for got in content] == [engine.tokenizer.decode([want.token]) for want in expected]
    for got, want in zip(content, expected, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert len(got.top_logprobs) == 3 and got.top_logprobs[0].logprob >= got.top_logprobs[-1].logprob
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client(fenced, "key-a").completions.create(
            model=MODEL, prompt="Hi", max_tokens=2, extra_body={"prompt_logprobs": 1}
        )


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_structured_output_and_forced_tools_through_the_router(fenced: Cluster, smollm2: GGUFModel) -> None:
    """The guide travels to decode, which compiles and enforces it on every token it samples: a json_schema
    answer is the single node's under the same grammar, a forced tool call comes back as a call."""
    a = client(fenced, "key-a")
    messages = [{"role": "user", "content": "Name a large city in France as JSON."}]
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY}}
    reply = a.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=32, temperature=0, response_format=response_format
    )
    content = reply.choices[0].message.content
    assert "city" in json.loads(content)
    engine = real_engine(smollm2)
    assert engine.tokenizer is not None
    grammar = GrammarCompiler(engine.tokenizer, engine.model.config.vocab_size).for_schema(CITY)
    request = engine.add_request(
        chat_ids(engine.tokenizer, messages[0]["content"]), SamplingParams(max_tokens=32), grammar=grammar
    )
    while not request.is_finished:
        engine.step()
    assert content == request.output_text
    tool = {"type": "function", "function": {"name": "locate", "parameters": CITY}}
    called = a.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=48, temperature=0, tools=[tool], tool_choice="required"
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "locate" and "city" in json.loads(call.function.arguments)


def test_n_choices_through_the_router(fenced: Cluster) -> None:
    """n goes to decode, which computes the prompt once and forks it: n choices come back, each with its
    index, in one body and in one stream; usage counts every choice's tokens."""
    a = client(fenced, "key-a")
    messages = [{"role": "user", "content": "Write a word."}]
    reply = a.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage is not None and reply.usage.completion_tokens >= 3
    events = {(e["where"], e["kind"]) for e in fenced.audit(reply.id)}
    assert ("decode", "forked") in events, events
    chunks = a.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=1.0, n=2, stream=True
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_incident_is_refused_before_any_reservation(fenced: Cluster) -> None:
    b = client(fenced, "key-b")
    with pytest.raises(openai.BadRequestError) as err:
        b.with_options(max_retries=0).chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=16
        )
    assert err.value.code == "context_length_exceeded"
    request_id = err.value.response.headers["x-request-id"]
    kinds = [(e["where"], e["kind"]) for e in fenced.audit(request_id)]
    assert kinds == [("router", "rejected")], "something was reserved, transferred or run for B"


def test_audit_info_names_both_pools(fenced: Cluster, smollm2: GGUFModel) -> None:
    """Each worker reports its own pins through the router: the same model file, its own pool."""
    response = httpx.get(f"{fenced.url}/v1/audit/info", headers={"Authorization": f"Bearer {ADMIN}"})
    assert response.status_code == 200, response.text
    info = response.json()
    assert (info["mode"], info["max_model_len"], sorted(info["pools"])) == (
        "disaggregated",
        512,
        ["decode", "prefill"],
    )
    pools = info["pools"]
    assert {pool["model_sha256"] for pool in pools.values()} == {file_sha256(smollm2.path)}
    assert (pools["prefill"]["num_pages"], pools["decode"]["num_pages"]) == (
        PREFILL.num_pages,
        DECODE.num_pages,
    )
    assert pools["decode"]["prefix_caching"] is False and all(p["isolation"] for p in pools.values())
    assert info["transport"] == {"kind": "zeromq", "authenticated": True}
    for pool in pools.values():  # each worker also names how its KV pages move, and what that trusts
        transport = pool["transport"]
        assert (transport["kind"], transport["authenticated"], transport["data_plane_sealed"]) == (
            "zeromq",
            True,
            True,
        )
        if transport["kv"] == "nixl":  # UCX lives in a landing process of its own uid, on loopback only
            assert transport["agent"] == "landing process" and transport["pool_registered"] is False
            assert transport["ucx_interface"] == "lo" and transport["seal"] == "aes-256-gcm"
            assert transport["uid"] not in (0, 65534, os.geteuid())
            assert transport["conditions"] == dict.fromkeys(
                ("landing_process", "separate_uid", "not_dumpable", "one_interface", "curve"), True
            )
    landing_uids = [pool["transport"]["uid"] for pool in pools.values() if pool["transport"]["kv"] == "nixl"]
    assert len(set(landing_uids)) == len(landing_uids)  # no two landing processes share a uid


def test_metrics_keep_the_pools_apart(fenced: Cluster) -> None:
    """/metrics has one series per pool, labelled by role: a full decode pool cannot hide behind an idle
    prefill pool in a sum."""
    for role, config in (("prefill", PREFILL), ("decode", DECODE)):
        assert metric(fenced.url, "kvfence_pages_free", {"role": role}, ADMIN) == config.num_pages
        # kvfence_pages without a state: summed over states, every page of the pool
        assert metric(fenced.url, "kvfence_pages", {"role": role}, ADMIN) == config.num_pages
        assert fenced.worker_stats(role).transport_rejected == {}  # honest traffic drops nothing
    with pytest.raises(KeyError):
        metric(fenced.url, "kvfence_pages_free", {"role": "router"}, ADMIN)  # the router has no pool
    assert not fenced.router.rejected


def test_prefill_crash_mid_load_fails_only_its_requests(smollm2: GGUFModel) -> None:
    """worker_crash_mid_transfer: kill -9 of the prefill process; decode drains its quarantine on the lost
    connection, the router answers an error, and nothing leaks."""
    with disaggregated(isolation=True) as running:
        a = client(running, "key-a")
        reply = a.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        running.workers["prefill"].kill()  # SIGKILL, then wait (bounded) for the process to be gone
        with pytest.raises(openai.APIError):
            a.with_options(timeout=60).chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Tell me a story about a lighthouse."}],
                max_tokens=8,
            )
        stats = running.worker_stats("decode")
        assert stats.pages_by_state["quarantined"] == 0
        assert stats.pages_free == stats.num_pages


def test_incident_leaks_with_isolation_off(smollm2: GGUFModel) -> None:
    """The 2026 incident reproduced: with the fence off and prefill swapping an over-long prompt for a
    one-token placeholder, B's decode reads pages last written by tenant A and answers a fluent 200."""
    with disaggregated(isolation=False, prefill_faults={"placeholder_transfer": 1.0}) as running:
        a = client(running, "key-a")
        for i in range(2):
            a.completions.create(
                model=MODEL,
                prompt=SECRET * 10 + f"Question {i}: what is the code?",
                max_tokens=8,
                temperature=0,
            )
        b = client(running, "key-b").chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}], max_tokens=16, temperature=0
        )
        assert b.http_response.status_code == 200
        request_id = b.headers["x-request-id"]
        events = running.audit(request_id)
        writers = {p["last_writer"] for e in events if e["kind"] == "pages_read" for p in e["pages"]}
        assert "tenant-a" in writers, f"B read no page of tenant A: {writers}"
        assert any(e["kind"] == "fault_injected" and e["fault"] == "placeholder_transfer" for e in events)
    engine = real_engine(smollm2, max_model_len=1024)
    assert engine.tokenizer is not None
    solo = engine.generate([chat_ids(engine.tokenizer, LONG_PROMPT)], SamplingParams(max_tokens=16))[0]
    assert b.parse().choices[0].message.content != solo.output_text


def landing_pid(cluster: Cluster, role: str) -> int | None:
    """The worker's landing process, as the OS shows it (a child running the landing module)."""
    worker = cluster.workers[role].pid
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == worker and b"kvfence.disagg.landing_process" in cmdline and stat[0] not in "TZ":
            return int(entry.name)
    return None


def transport_of(cluster: Cluster, role: str) -> dict:
    info = httpx.get(f"{cluster.url}/v1/audit/info", headers={"Authorization": f"Bearer {ADMIN}"}).json()
    return info["pools"][role]["transport"]


def ask(cluster: Cluster, key: str, question: str) -> str:
    """The answer, or the error's class: every request ends one way or the other (a hang fails the test
    by the client's own timeout)."""
    try:
        reply = (
            client(cluster, key)
            .with_options(timeout=120)
            .chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=8, temperature=0
            )
        )
    except openai.APIError as exc:
        return type(exc).__name__
    return reply.choices[0].message.content or ""


def after(cluster: Cluster, questions: dict[str, str]) -> dict[str, str]:
    """Each tenant's first answer once answers resume: a request sent while the new landing process
    starts (a fresh interpreter, a second or two) fails closed, as during the fault."""
    answers = {}
    for key, question in questions.items():
        for _ in range(40):
            if "Error" not in (answer := ask(cluster, key, question)):
                answers[key] = answer
                break
            time.sleep(0.5)
    return answers


@pytest.mark.skipif(
    os.geteuid() != 0 or not nixl_available(), reason="no landing process: not root or no NIXL"
)
@pytest.mark.parametrize("how", [signal.SIGSTOP, signal.SIGKILL])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stopped_or_killed_landing_process_fails_closed_and_answers_resume(
    fenced: Cluster, role: str, how: signal.Signals
) -> None:
    """Any uid-65534 process could once stop a landing process and leave every tenant without an answer.
    Under two tenants' traffic, the landing process is stopped or killed: every request ends (an answer or
    an error), the worker replaces its landing process, and both tenants' answers resume, the same as
    before; /v1/audit/info names the new process. Nothing of it stays quarantined."""
    questions = {"key-a": "What is the capital of France?", "key-b": "Name a large ocean."}
    before = {key: ask(fenced, key, q) for key, q in questions.items()}
    victim = landing_pid(fenced, role)
    assert victim is not None
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(ask, fenced, key, q) for key, q in [*questions.items()] * 2]
        os.kill(victim, how)
        ended = [future.result() for future in running]
    assert len(ended) == 4  # every request came back
    while landing_pid(fenced, role) in (None, victim):
        time.sleep(0.1)  # its replacement starts (a fresh interpreter)
    assert after(fenced, questions) == before
    while (transport := transport_of(fenced, role))["state"] != "serving":
        time.sleep(0.1)  # pages went as ZeroMQ frames meanwhile: the new process takes a second to start
    assert transport["pid"] == landing_pid(fenced, role)  # the process serving now, not the one at start
    assert transport["restarts"] >= 1 and transport["data_plane_sealed"] is True
    stats = fenced.worker_stats("decode")
    assert stats.pages_by_state["quarantined"] == 0
