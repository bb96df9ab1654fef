"""The replay check on the real model (SmolLM2-135M): what kvfence guarantees about batch invariance, and
`kvfence audit --black-box` failing a kvfence that answers from someone else's KV.

- Engine level (offline, LLMEngine): the replay prompts' greedy answers alone equal their answers under
  mixed load (another tenant's long prompt in chunks, a request cancelled mid-flight); their top-2 logit
  gaps leave room for the ~1e-5 by which prefill numerics move with chunking; decode rows are bitwise
  batch-invariant where the engine pins `batch_invariant`, and the dense path does not pin it.
- Audit level (in-process server, `kvfence.harness.cluster`): with the fence off and a single-node fault
  armed (read_beyond_written, cross_tenant_prefix_hit) the audit exits 1 with replay FAIL naming the
  changed requests and their pages; with the fence on under the same faults it passes, the fence's aborts
  reported.
(The clean server is audited in test_audit.py; the INCONCLUSIVE path against stand-in servers there too.)
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LogitsRecorder, real_engine

from kvfence.audit.canaries import new_canary, victim_prompt
from kvfence.audit.cli import run
from kvfence.audit.client import ProbeClient, Target, discover
from kvfence.audit.options import add_arguments
from kvfence.audit.replay import REPLAY_MAX_TOKENS, REPLAY_PROMPTS, run_replay
from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.engine.info import engine_info
from kvfence.harness.cluster import cluster
from kvfence.harness.key_files import audit_key_args
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.request import Request
from kvfence.sampling import SamplingParams

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_torch_thread")]

ADMIN = "replay-admin"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
SMALL = {"num_pages": 64, "max_model_len": 512}  # a 512-token window: a fast boundary, short long prompts
MARGIN = (
    1e-3  # least top-2 logit gap of every greedy step of every replay prompt (measured: 0.016; canaries 3)
)
GREEDY = SamplingParams(max_tokens=REPLAY_MAX_TOKENS)


# ---- engine level -----------------------------------------------------------------------------------


def replay_prompts(tokenizer: Tokenizer, long: bool = False) -> list[list[int]]:
    """The replay prompts as the server tokenizes them (a chat through the file's template); `long`: and a
    long canary victim, as each tenant's long replay prompt is (20 records here, about 460 tokens)."""
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if endpoint == "chat" else prompt
        for endpoint, prompt in REPLAY_PROMPTS
    ]
    texts += [victim_prompt(new_canary(), 20)] if long else []
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


def offline(model: Transformer, tokenizer: Tokenizer, **overrides: Any) -> LLMEngine:
    config: dict[str, Any] = {"num_pages": 256, "max_model_len": 2048} | overrides
    return LLMEngine(EngineConfig(**config), model, tokenizer, log=lambda _: None)


def alone(engine: LLMEngine, prompts: list[list[int]]) -> list[Request]:
    """Each prompt by itself: no other request ever shares its steps."""
    return [engine.generate([prompt], GREEDY, tenant="probe")[0] for prompt in prompts]


def under_load(engine: LLMEngine, prompts: list[list[int]], long: list[int]) -> list[Request]:
    """The prompts admitted one per step while another tenant's long prompt prefills in chunks, a second
    long one starts and is cancelled mid-flight, and finished rows leave the batch."""
    engine.add_request(long, SamplingParams(max_tokens=4), "other")
    engine.step()
    probes, cancelled = [], None
    for i, prompt in enumerate(prompts):
        probes.append(engine.add_request(prompt, GREEDY, "probe"))
        if i == 2:
            cancelled = engine.add_request(long[::-1], SamplingParams(max_tokens=32), "other")
        if i == 5 and cancelled is not None:
            engine.abort(cancelled.request_id)
        engine.step()
    while not all(r.is_finished for r in probes):
        engine.step()
    return probes


def test_greedy_answers_alone_equal_answers_under_load(smollm2: GGUFModel) -> None:
    model, tokenizer = Transformer.from_gguf(smollm2), Tokenizer.from_gguf(smollm2)
    prompts = replay_prompts(tokenizer, long=True)
    solo_engine = offline(model, tokenizer)
    logits = LogitsRecorder(solo_engine)
    solo = alone(solo_engine, prompts)
    long = tokenizer.encode(" ".join(f"Item {i} sits in bin {i * 7 % 13}." for i in range(150)))[:900]
    loaded = under_load(offline(model, tokenizer, max_num_batched_tokens=96), prompts, long)
    assert engine_info(solo_engine)["batch_invariant"] is True
    for i, (a, b) in enumerate(zip(solo, loaded, strict=True)):
        assert a.output_token_ids == b.output_token_ids, f"replay prompt {i} changed under load"
        gaps = [
            float((lambda t: t[0] - t[1])(torch.topk(row, 2).values)) for row in logits.steps[a.request_id]
        ]
        assert min(gaps) >= MARGIN, f"replay prompt {i}: a greedy step's top-2 gap is {min(gaps):.1e}"


def _decoded_beside_others(engine: LLMEngine, prompt: list[int], others: list[list[int]]) -> Request:
    """`prompt` prefilled alone (its first step has no other row), then decoded while `others` prefill in
    chunks and decode beside it."""
    probe = engine.add_request(prompt, GREEDY, "probe")
    engine.step()
    for other in others:
        engine.add_request(other, SamplingParams(max_tokens=12), "other")
    while not probe.is_finished:
        engine.step()
    return probe


@pytest.mark.parametrize("decode_matmul", ["auto", "dense"])
def test_decode_rows_are_bitwise_batch_invariant_where_pinned(smollm2: GGUFModel, decode_matmul: str) -> None:
    """What `batch_invariant` promises: with the kernels every decode step's logits are the solo ones, bit
    for bit, whatever shares the step. The dense (BLAS) path does not claim it, and only its claim is
    checked: whether BLAS changes a row's bits with the batch depends on the library and the CPU (on an
    AVX2 EPYC it did; on a Sapphire Rapids Xeon, for these shapes, it did not)."""
    model, tokenizer = (
        Transformer.from_gguf(smollm2, decode_matmul=decode_matmul),
        Tokenizer.from_gguf(smollm2),
    )
    solo_engine = offline(model, tokenizer)
    pinned = engine_info(solo_engine)["batch_invariant"]
    assert pinned is (decode_matmul == "auto")
    if not pinned:
        return
    prompt, others = replay_prompts(tokenizer)[0], replay_prompts(tokenizer)[1:6]
    solo_logits = LogitsRecorder(solo_engine)
    solo = solo_engine.generate([prompt], GREEDY)[0]
    loaded_engine = offline(model, tokenizer, max_num_batched_tokens=48)
    loaded_logits = LogitsRecorder(loaded_engine)
    loaded = _decoded_beside_others(loaded_engine, prompt, others)
    pairs = zip(solo_logits.steps[solo.request_id], loaded_logits.steps[loaded.request_id], strict=False)
    bitwise = [torch.equal(a, b) for a, b in pairs]
    assert solo.output_token_ids == loaded.output_token_ids and all(bitwise), bitwise


# ---- audit level ------------------------------------------------------------------------------------


def audit(url: str, out: Path) -> tuple[int, dict[str, Any]]:
    """`kvfence audit --black-box` with the admin key (it reads only the pin and changed trails)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    report = out / "report.json"
    argv = ["--url", url, *audit_key_args(out, ["key-a", "key-b"], ADMIN), "--black-box"]
    status = run(parser.parse_args([*argv, "--json", str(report)]))
    return status, json.loads(report.read_text(encoding="utf-8"))


def replay_check(report: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in report["checks"] if c["name"] == "replay")


# Rates that change about half the replayed answers with the fence off (measured 10/20 and 11/20) and, with
# the fence on, still let 8 or more through to compare (measured 18 to 20).
FAULTS = {"read_beyond_written": 0.3, "cross_tenant_prefix_hit": 0.3}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_audit_fails_kvfence_answering_from_stale_kv(smollm2: GGUFModel, tmp_path: Path, fault: str) -> None:
    """One fault traces pages (`pages_read`, whose data each held), the other names pages from the
    allocations and prefix hits."""
    trace = fault == "read_beyond_written"
    engine = real_engine(smollm2, isolation=False, faults={fault: FAULTS[fault]}, trace_pages=trace, **SMALL)
    with cluster(engine, api_keys=KEYS, admin_key=ADMIN) as running:
        status, report = audit(running.url, tmp_path)
    replay = replay_check(report)
    assert status == 1 and replay["status"] == "FAIL", replay["details"]
    mismatches = [item for item in replay["evidence"] if "problem" in item]
    assert mismatches and all(m["request_id"] in replay["details"] for m in mismatches[:4])
    assert all(m["pages"]["pages"] for m in mismatches), "the changed requests' pages are named"
    source = "pages_read" if trace else "pages_allocated/prefix_hit"
    assert {m["pages"]["source"] for m in mismatches} == {source}
    assert report["target"]["batch_invariant_declared"] is True


def test_audit_passes_kvfence_with_the_fence_on_under_the_same_faults(
    smollm2: GGUFModel, tmp_path: Path
) -> None:
    engine = real_engine(smollm2, faults=FAULTS, **SMALL)
    with cluster(engine, api_keys=KEYS, admin_key=ADMIN) as running:
        status, report = audit(running.url, tmp_path)
    failing = {c["name"]: c["details"] for c in report["checks"] if c["status"] == "FAIL"}
    assert status == 0 and not failing, failing
    replay = replay_check(report)
    summary = replay["evidence"][0]
    assert replay["status"] == "PASS" and summary["compared"] >= 8 and summary["changed"] == 0, summary
    assert summary["integrity_aborts"] > 0, "the faults fired and the fence aborted nothing?"


def replay_alone(url: str) -> dict[str, Any]:
    """The replay check by itself (no other probe), as a tenant sees the server: its pin read from the
    model card; each tenant's long canary victim (12 records, about 280 tokens) fills pages with other
    text, as the audit's earlier probes do, so a stale read has something else to find."""
    served = discover(url, "key-a")
    client = ProbeClient(Target(url, tuple(KEYS), served.model))
    long_prompts = [(victim_prompt(canary, 12), canary) for canary in (new_canary(), new_canary())]
    try:
        result, _ = run_replay(client, long_prompts, served.batch_invariant)
    finally:
        client.close()
    return {"status": result.status, "details": result.details, "evidence": result.evidence}


# One fault here (bench/audit_faults.py --hide-pin measures every fault's catch rate over several runs).
@pytest.mark.parametrize("fault", ["cross_tenant_prefix_hit", None], ids=["cross_tenant_prefix_hit", "clean"])
def test_the_near_tie_oracle_judges_kvfence_with_its_pin_hidden(
    smollm2: GGUFModel, fault: str | None
) -> None:
    """kvfence hiding its batch-invariance pin (`--hide-batch-invariance`) is judged as any engine that
    answers logprobs: with the fence off and a fault armed, answers from stale KV depart from their solo
    answers where the solo run was sure (FAIL, beyond the margin); clean, it passes. The pin is hidden in
    the model card, so the exact rule cannot decide. Each departure beyond the margin is re-scored alone,
    teacher-forced with `echo` (audit/confirm.py), beside the solo run's logprob of its own token."""
    faults = {fault: FAULTS[fault]} if fault else {}
    engine = real_engine(
        smollm2, isolation=fault is None, faults=faults, declare_batch_invariance=False, **SMALL
    )
    with cluster(engine, api_keys=KEYS, admin_key=ADMIN) as running:
        assert discover(running.url, "key-a").batch_invariant is False
        replay = replay_alone(running.url)
    summary = replay["evidence"][0]
    assert summary["oracle"] == "near-tie" and summary["calibration_answers"] > 0, summary
    if fault is None:
        assert replay["status"] == "PASS" and summary["beyond"] == 0, replay["details"]
        assert summary["margin_nats"] < 0.1, "fp32 CPU jitter is ~1e-5: the margin stays at its floor"
    else:
        assert replay["status"] == "FAIL" and summary["beyond"] > 0, replay["details"]
        assert "beyond the margin" in replay["details"]
        beyond = [item for item in replay["evidence"] if item.get("verdict") == "beyond"]
        confirmed = [item for item in beyond if "logprob" in item.get("confirmation", {})]
        assert confirmed, "echo with logprobs re-scores the departing token in its true context"
        for item in confirmed:
            # Which side read stale KV is for the reader: the fault may hit the solo run as well.
            checked = item["confirmation"]
            assert checked["request"]["echo"] is True and checked["token"] == item["departure"]["other_token"]
            assert math.isfinite(checked["logprob"]) and checked["logprob"] <= 0 and "solo_logprob" in checked
        assert "teacher-forced" in replay["details"]
