"""`kvfence lab`: the four requests of the isolation lab (seed 003), on the real model and engine.

Every case starts from a pool seeded with tenant A's pages (A's prompt holds a recognisable secret; A has
finished, so its pages are free but not zeroed), then runs tenant B:

  normal                  B needs 3 pages                              reads only B's pages
  oversize_rejected       B's prompt exceeds what can be served        refused: nothing allocated/sent/run
  rejected_but_continues  the defect armed, isolation off              B reads pages holding A's data
  patched_rejection       the same defect armed, isolation on          refused (or aborted): nothing read

Single node, the defect is `read_beyond_written` (B believes its prompt is already cached). Disaggregated
(prefill + decode workers over real ZeroMQ, in this process), it is the incident itself:
`placeholder_transfer` behind a router that checks only the window. The table is built from the audit
trail, so it shows what the engine recorded, not what the lab intended. Its `replay` column is the audit's
output oracle (audit/replay.py) in small: B's answer against the same prompt answered alone on a fresh,
clean engine, `same` or `changed` (`-` when B was not answered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from kvfence.config import EngineConfig
from kvfence.disagg.handoff import HandoffEngine
from kvfence.disagg.router import Router
from kvfence.engine.engine import AdmissionError, LLMEngine
from kvfence.harness.cluster import cluster
from kvfence.harness.workers import InThread
from kvfence.model.gguf import GGUFModel
from kvfence.model.hf_load import load_model
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.pins import default_model_path
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

SECRET = (
    "Confidential note for tenant A. The vault access code is 4471-ALPHA-RIVER, the board meets on "
    "the ninth of March, and project Heron ships to the northern warehouse first. "
)
PAGE = 16
MAX_TOKENS = 8


@dataclass(frozen=True)
class Case:
    name: str
    prompt_tokens: int  # B's prompt length (chat-templated, approximately)
    isolation: bool
    defect: bool
    expect: str  # "clean", "refused" or "leak"


CASES = [
    Case("normal", 36, isolation=True, defect=False, expect="clean"),
    Case("oversize_rejected", 300, isolation=True, defect=False, expect="refused"),
    Case("rejected_but_continues", 300, isolation=False, defect=True, expect="leak"),
    Case("patched_rejection", 300, isolation=True, defect=True, expect="refused"),
]
# Single node the defect is a belief, not a size: B's prompt must fit, so its defect case uses 120 tokens.
SINGLE_DEFECT_PROMPT = 120


@dataclass
class Row:
    mode: str
    case: str
    requested: int  # pages B needs for prompt + completion
    allocated: int
    transferred: int
    steps: int
    pages_read: int
    foreign_read: int  # pages read whose owner or last writer is not B
    status: str
    pool_unchanged: bool | None  # refused cases only: every pool byte-for-byte as before B
    output: str
    replay: str = "-"  # B's answer vs the same prompt alone on a clean engine: same | changed | -
    passed: bool = False


def b_prompt(tokenizer: Tokenizer, tokens: int) -> list[int]:
    """A chat prompt for tenant B of about `tokens` tokens (distinct from A's)."""
    filler = " ".join(f"item {i} is green;" for i in range(tokens // 5))
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "List: " + filler}]))
    return ids[:tokens] if len(ids) > tokens else ids


def a_prompt(tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": SECRET * 3}]))


def summarise(
    mode: str,
    case: Case,
    prompt: list[int],
    events: list[dict[str, Any]],
    status: str,
    output: str,
    unchanged: bool | None,
    solo: str | None = None,
) -> Row:
    reads = [p for e in events if e["kind"] == "pages_read" for p in e["pages"]]
    row = Row(
        mode=mode,
        case=case.name,
        requested=cdiv(len(prompt) + MAX_TOKENS, PAGE),
        allocated=sum(len(e["pages"]) for e in events if e["kind"] == "pages_allocated"),
        transferred=sum(1 for e in events if e["kind"] == "page_received"),
        steps=sum(1 for e in events if e["kind"] == "step"),
        pages_read=len(
            {(e.get("where"), p["page"]) for e in events if e["kind"] == "pages_read" for p in e["pages"]}
        ),
        foreign_read=sum(1 for p in reads if p["owner"] != "B" or p["last_writer"] != "B"),
        status=status,
        pool_unchanged=unchanged,
        output=output,
        replay="-" if solo is None or status != "finished" else "same" if output == solo else "changed",
    )
    row.passed = _meets(case.expect, row)
    return row


def _meets(expect: str, row: Row) -> bool:
    if expect == "clean":
        return (
            row.status == "finished" and row.pages_read > 0 and row.foreign_read == 0 and row.replay == "same"
        )
    if expect == "leak":
        return row.status == "finished" and row.foreign_read > 0 and row.replay == "changed"
    return (
        row.status in ("rejected", "aborted")
        and row.allocated == row.transferred == row.steps == 0
        and row.pool_unchanged is True
    )


# ---- pools ----------------------------------------------------------------------------------------------


def snapshot(engines: list[LLMEngine]) -> list[tuple[torch.Tensor, ...]]:
    return [
        (
            e.pool.kv.clone(),
            *(
                torch.from_numpy(a.copy())
                for a in (e.pool.generation, e.pool.owner, e.pool.written, e.pool.state)
            ),
        )
        for e in engines
    ]


def same(before: list[tuple[torch.Tensor, ...]], after: list[tuple[torch.Tensor, ...]]) -> bool:
    return all(
        torch.equal(x, y) for b, a in zip(before, after, strict=True) for x, y in zip(b, a, strict=True)
    )


# ---- replay --------------------------------------------------------------------------------------------


def solo_output(model: Transformer, tokenizer: Tokenizer, prompt: list[int]) -> str:
    """B's prompt answered alone on a fresh engine with the fence on and no fault: what a case's answer
    must equal (the engine is batch-invariant, so neither the pool nor A's pages may change it)."""
    config = EngineConfig(num_pages=32, max_model_len=512, enable_prefix_caching=False)
    engine = LLMEngine(config, model, tokenizer, log=lambda _: None)
    return engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS), tenant="B")[0].output_text


# ---- single node ----------------------------------------------------------------------------------------


def run_single(model: Transformer, tokenizer: Tokenizer, case: Case) -> Row:
    config = EngineConfig(
        num_pages=16,
        max_model_len=256,
        enable_prefix_caching=False,
        trace_pages=True,
        isolation=case.isolation,
    )
    engine = LLMEngine(config, model, tokenizer, log=lambda _: None)
    engine.generate([a_prompt(tokenizer)], SamplingParams(max_tokens=MAX_TOKENS), tenant="A")
    prompt = b_prompt(
        tokenizer, SINGLE_DEFECT_PROMPT if case.defect and not case.isolation else case.prompt_tokens
    )
    if case.defect:
        engine.faults.arm("read_beyond_written", times=1)
    before = snapshot([engine])
    try:
        request = engine.add_request(prompt, SamplingParams(max_tokens=MAX_TOKENS), "B", request_id="b")
        while not request.is_finished:
            engine.step()
        status, output = request.status.value, request.output_text
        if request.status.value == "aborted":
            status = f"aborted ({request.finish_reason})"
    except AdmissionError as refusal:
        status, output = "rejected", f"400 {refusal.code}"
    unchanged = same(before, snapshot([engine])) if status.startswith(("rejected", "aborted")) else None
    solo = solo_output(model, tokenizer, prompt) if status == "finished" else None
    events = engine.events.for_request("b")
    return summarise("single", case, prompt, events, status.split(" ")[0], output, unchanged, solo)


# ---- disaggregated ----------------------------------------------------------------------------------------


def engines(model: Transformer, tokenizer: Tokenizer, case: Case) -> tuple[HandoffEngine, HandoffEngine]:
    """The prefill engine (a pool of 256 tokens, the defect armed on it) and the decode engine (512 tokens,
    tracing the pages each step reads); neither caches prefixes."""
    base = EngineConfig(enable_prefix_caching=False, isolation=case.isolation)
    faults = {"placeholder_transfer": 1.0} if case.defect else {}
    prefill = HandoffEngine(
        replace(base, num_pages=16, max_model_len=256, faults=faults), model, tokenizer, log=lambda _: None
    )
    decode = HandoffEngine(
        replace(base, num_pages=32, max_model_len=512, trace_pages=True), model, tokenizer, log=lambda _: None
    )
    return prefill, decode


async def _collect(router: Router, prompt: list[int], tenant: str, request_id: str) -> tuple[str, str]:
    text, status = "", "finished"
    async for output in router.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), tenant, request_id):
        text += output.new_text
        if output.finished:
            status = output.status.value
    return status, text


def run_disaggregated(model: Transformer, tokenizer: Tokenizer, case: Case) -> Row:
    """Prefill and decode workers on threads of this process over real ZeroMQ (TCP), the router in front,
    started and stopped by the harness; the engines stay here so the pools can be compared."""
    prefill, decode = engines(model, tokenizer, case)
    pools: list[LLMEngine] = [prefill, decode]
    with cluster(
        prefill=InThread(prefill), decode=InThread(decode), http=False, isolation=case.isolation
    ) as running:
        router = running.router
        asyncio.run(_collect(router, a_prompt(tokenizer), "A", "a"))
        prompt = b_prompt(tokenizer, case.prompt_tokens)
        before = snapshot(pools)
        try:
            status, output = asyncio.run(_collect(router, prompt, "B", "b"))
        except AdmissionError as refusal:
            status, output = "rejected", f"400 {refusal.code}"
        unchanged = same(before, snapshot(pools)) if status in ("rejected", "aborted") else None
        events = router.audit_events("b")
    solo = solo_output(model, tokenizer, prompt) if status == "finished" else None
    return summarise("disaggregated", case, prompt, events, status, output, unchanged, solo)


# ---- the command ------------------------------------------------------------------------------------------


def run_lab(gguf: GGUFModel, modes: list[str], progress: Callable[[str], None]) -> list[Row]:
    model, tokenizer = Transformer.from_gguf(gguf), Tokenizer.from_gguf(gguf)
    rows = []
    for mode in modes:
        for case in CASES:
            progress(f"{mode}: {case.name}")
            rows.append(
                run_single(model, tokenizer, case)
                if mode == "single"
                else run_disaggregated(model, tokenizer, case)
            )
    return rows


def format_table(rows: list[Row]) -> str:
    head = (
        "mode",
        "case",
        "requested",
        "allocated",
        "transferred",
        "steps",
        "read",
        "foreign",
        "replay",
        "status",
        "pool same",
        "ok",
        "B's output",
    )
    lines = [head] + [
        (
            r.mode,
            r.case,
            str(r.requested),
            str(r.allocated),
            str(r.transferred),
            str(r.steps),
            str(r.pages_read),
            str(r.foreign_read),
            r.replay,
            r.status,
            "-" if r.pool_unchanged is None else str(r.pool_unchanged).lower(),
            "PASS" if r.passed else "FAIL",
            r.output.replace("\n", " ")[:40],
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def run(args: argparse.Namespace) -> int:
    gguf = load_model(args.model or default_model_path())
    modes = ["single", "disaggregated"] if args.mode == "both" else [args.mode]
    rows = run_lab(gguf, modes, progress=lambda line: print(f"... {line}", flush=True))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    failed = [f"{r.mode}/{r.case}" for r in rows if not r.passed]
    print("lab: every case matches its expectation" if not failed else f"lab: FAILED {', '.join(failed)}")
    return 1 if failed else 0
