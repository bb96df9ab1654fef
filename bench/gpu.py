"""The GPU fast path, checked and measured in one run (issue 18): under 5 minutes on a GPU machine.

    python bench/gpu.py                      # the device's defaults: CUDA, W1 at 64 and 256
    python bench/gpu.py --device cpu --quick # small sizes: that the script works, on any machine
    python bench/gpu.py --quick              # on a GPU machine: the checks alone, W1 at small sizes

One table, and bench/results/gpu.json:
  golden      greedy tokens on the device == the CPU path's, and == HF transformers' on the device (to EOS)
  batched     the golden prompts together == each alone, on the device
  faults      each single-node fault: isolation off leaks (the victim's tokens change), on aborts exactly
              the culprit with its reason while the others keep their solo tokens (the scenarios of
              tests/unit/test_fence_faults.py, on the real model)
  graphs      a decode step of one row fewer than its bucket (so a padding row runs, in the scratch page)
              replayed from a captured graph (CUDA; an eager stand-in on CPU: no capture, so there the row
              checks padding and the fence only) vs the eager forward: the fence validates the step's layout,
              the graph's static buffers name exactly that layout (padding: the scratch page only), greedy
              tokens equal; logits max diff, ms per step; the decode attention in use
  W1          256 requests, 64 prompt / 128 output tokens, greedy, ignore_eos, at concurrency 64 and 256,
              and HF generate() at the same batch sizes in the same run; fence share of step time
  server      TPOT p50/p95 through a `kvfence serve` process on the device, W1 prompts streamed by 16 and
              64 clients; on CUDA again through one with --enforce-eager (no graphs); skipped, with the
              reason, when the server cannot start
Every PASS/FAIL row is a verdict, and a section that raised is one that failed: the script exits 1 when
any failed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from common import (
    VERDICTS,
    W1,
    RunResult,
    build_engine,
    exit_status,
    load_hf_model,
    load_weights,
    make_prompts,
    run_kvfence,
    run_streams,
    write_json,
)

from kvfence.cache.fence import Fence, StepLayout
from kvfence.engine.engine import LLMEngine
from kvfence.engine.graphs import CudaGraphBackend, DecodeBatch, DecodeGraphRunner, Replay, bucket_for
from kvfence.engine.runner import build_layout
from kvfence.engine.scheduler import Batch
from kvfence.harness.tables import print_table
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

REPO = Path(__file__).resolve().parent.parent
SERVER_CLIENTS = (16, 64)
GOLDEN = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,"]
Row = tuple[str, str, str]  # check, result, detail


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes: 16 requests, 16 tokens, c4/c16")
    return parser.parse_args()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_on(gguf: GGUFModel, model: Transformer, **overrides: Any) -> LLMEngine:
    """An engine as `kvfence serve` builds one: on CUDA, decode steps replayed from captured graphs."""
    settings = {"decode_graphs": True} | overrides
    return build_engine(gguf, model=model, device=str(model.device), **settings)


def greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens)
    return [r.output_token_ids for r in engine.generate(prompts, params)]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], max_tokens: int, device: str) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt], device=device)
        out = hf.generate(input_ids=ids, do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt) :].tolist()


def up_to_eos(tokens: list[int], stops: set[int]) -> list[int]:
    cut = next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]


def golden_rows(
    gguf: GGUFModel, model: Transformer, hf: torch.nn.Module, device: str, tokens: int
) -> list[Row]:
    engine = engine_on(gguf, model)
    assert engine.tokenizer is not None
    prompts = [engine.tokenizer.encode(text) for text in GOLDEN]
    ours = greedy(engine, prompts, tokens)
    cpu = greedy(build_engine(gguf), prompts, tokens) if device != "cpu" else ours
    stops = engine.tokenizer.stop_token_ids
    theirs = [up_to_eos(hf_greedy(hf, p, tokens, device), stops) for p in prompts]
    solo = [greedy(engine, [p], tokens)[0] for p in prompts]
    same_cpu = sum(a == b for a, b in zip(ours, cpu, strict=True))
    same_hf = sum(up_to_eos(a, stops) == b for a, b in zip(ours, theirs, strict=True))
    same_solo = sum(a == b for a, b in zip(ours, solo, strict=True))
    n = len(prompts)
    return [
        checked("golden tokens == CPU path", same_cpu == n, f"{same_cpu}/{n} prompts, {tokens} tokens"),
        checked("golden tokens == HF on device", same_hf == n, f"{same_hf}/{n} prompts, up to EOS"),
        checked("batched == solo", same_solo == n, f"{same_solo}/{n} prompts"),
    ]


def checked(name: str, passed: bool, detail: str) -> Row:
    """A verdict row: PASS or FAIL, and a FAIL fails the script's exit status."""
    return name, VERDICTS.record(name, passed), detail


def fault_cases(model: Transformer) -> types.ModuleType:
    """tests/unit/test_fence_faults.py's scenarios. Its conftest needs starlette and the tiny model, so a stub
    conftest gives it only `make_engine` over the real model; where pytest is missing, a stub of the one
    decorator the module uses at import."""

    def make_engine(_model: Transformer, **overrides: object) -> LLMEngine:
        settings = {"num_pages": 64, "page_size": 4, "max_num_batched_tokens": 64, "max_model_len": 48}
        settings |= {"device": str(model.device)} | overrides
        from kvfence.config import EngineConfig

        return LLMEngine(EngineConfig(**settings), model, log=lambda _: None)  # type: ignore[arg-type]

    def with_fake_graphs(_engine: LLMEngine) -> None:
        raise AssertionError("the cases run here with graphs=False: no fake capture on a device")

    stub = types.SimpleNamespace(make_engine=make_engine, with_fake_graphs=with_fake_graphs)
    sys.modules["conftest"] = stub  # type: ignore[assignment]
    if importlib.util.find_spec("pytest") is None:
        identity = types.SimpleNamespace(parametrize=lambda *a, **k: lambda f: f)
        sys.modules["pytest"] = types.SimpleNamespace(mark=identity)  # type: ignore[assignment]
    spec = importlib.util.spec_from_file_location("fence_faults", REPO / "tests/unit/test_fence_faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def fault_rows(model: Transformer) -> list[Row]:
    faults = fault_cases(model)
    rows = []
    for name, case in sorted(faults.CASES.items()):
        _, off, _ = faults.run_case(model, case, isolation=False)
        victim = off[case.leaked_into]
        leaked = victim.output_token_ids != faults.solo(model, victim, case.engine_settings)
        engine, on, _ = faults.run_case(model, case, isolation=True)
        culprit = on[case.aborted]
        caught = culprit.status is Status.ABORTED and culprit.finish_reason == case.reason
        others = all(
            r.output_token_ids == faults.solo(model, r, case.engine_settings)
            for label, r in on.items()
            if label != case.aborted
        )
        passed = leaked and caught and others and engine.integrity_aborts == {case.reason: 1}
        detail = (
            f"off: {'leaked' if leaked else 'no change'}; on: {culprit.finish_reason}, others solo {others}"
        )
        rows.append(checked(f"fault {name}", passed, detail))
    return rows


class EagerBackend:
    """The graph seam on CPU: no capture, the forward runs again on every replay. So on CPU the graph row
    checks the runner's padding and buffers and the fence, not what a capture adds (frozen addresses)."""

    def capture(self, fn: Replay) -> Replay:
        return fn


def timed(fn: Callable[[], object], device: str, repeat: int) -> float:
    """Seconds per call."""
    fn()
    sync(device)
    started = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - started) / repeat


def mid_decode(gguf: GGUFModel, model: Transformer, rows: int) -> tuple[LLMEngine, Batch, StepLayout]:
    """An engine (its pool with the scratch page) decoding `rows - 1` requests, its next step's batch and
    that step's layout."""
    engine = engine_on(gguf, model, max_num_seqs=rows, num_pages=rows * 6 + 8, max_model_len=80)
    assert engine.tokenizer is not None
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    # A tenant per row: a buffer naming another row's page is then a foreign read, which the fence names.
    for index, prompt in enumerate(make_prompts(engine.tokenizer, rows - 1, 40, salt=3)):
        engine.add_request(prompt, params, f"tenant-{index}")
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    batch = engine.scheduler.schedule()
    return engine, batch, build_layout(batch.requests, batch.num_new_tokens, engine.pool.page_size)


def graph_rows(gguf: GGUFModel, model: Transformer, device: str, rows: int) -> list[Row]:
    """One decode step of `rows - 1` requests in the `rows` bucket, so a padding row runs (a bucket-sized
    batch would never touch the scratch page): the graph replay against the eager forward, and the step the
    graph's buffers describe validated by the fence, as the runner validates a layout before a forward."""
    engine, batch, layout = mid_decode(gguf, model, rows)
    backend = CudaGraphBackend() if device == "cuda" else EagerBackend()
    graphs = DecodeGraphRunner(model, engine.pool, rows, max_pages_per_seq=8, backend=backend)
    tokens = torch.tensor([r.all_token_ids[r.num_computed_tokens] for r in batch.requests]).numpy()
    decode = DecodeBatch.from_layout(layout, tokens, engine.pool.page_size)
    inputs, _, _ = engine.runner._model_inputs(batch.requests, batch.num_new_tokens, layout)
    eager = model.forward(inputs, engine.pool.kv).clone()
    replayed = graphs.run(decode)
    assert replayed is not None
    replayed = replayed.clone()  # a view of the graph's output buffer, which the next replay overwrites
    bucket = bucket_for(decode.rows, graphs.buckets)
    assert bucket is not None
    violations = fence_on_replay(engine.fence, graphs, layout)
    padding = padding_in_scratch(graphs, decode.rows, bucket)
    diff = (replayed - eager).abs().max().item()
    same = bool(torch.equal(replayed.argmax(-1), eager.argmax(-1)))
    eager_s = timed(lambda: model.forward(inputs, engine.pool.kv), device, 10)
    graph_s = timed(lambda: graphs.run(decode), device, 10)
    # After other allocations: a replay reading a buffer freed since the capture differs (or asserts) here.
    again = bool(torch.equal(graphs.run(decode), replayed))
    kind = "CUDA graph" if device == "cuda" else "eager stand-in: padding and fence only, no capture"
    note = f"({model.decode_attention_note})" if model.decode_attention_note else ""
    return [
        checked(
            f"graph replay ({kind}), {decode.rows} rows in bucket {bucket}",
            not violations and padding and same and again,
            f"fence on the replayed layout: {violations or 'clean'}; {bucket - decode.rows} padding row(s) "
            f"in the scratch page only {padding}; argmax equal {same}, max |logit diff| {diff:.1e}; "
            f"the 12th replay == the first {again}",
        ),
        (
            f"decode forward {decode.rows} rows",
            f"{graph_s * 1e3:.2f} ms replayed",
            f"{eager_s * 1e3:.2f} ms eager; decode attention {model.decode_attention} {note}",
        ),
    ]


def fence_on_replay(fence: Fence, graphs: DecodeGraphRunner, layout: StepLayout) -> str:
    """What the fence finds in the step the graph replayed ('' when it validates), with the validation the
    runner runs on a layout before every forward."""
    replayed = replayed_layout(graphs, layout)
    if replayed is None:
        return "the buffers name other pages than the step's records"
    return ", ".join(f"row {row}: {reason}" for row, reason in fence.validate_step(replayed).items())


def replayed_layout(graphs: DecodeGraphRunner, layout: StepLayout) -> StepLayout | None:
    """The step the graph's static buffers (the device copies it read) describe for the real rows: the
    pages each row attends over, up to its context length, and each write's slot. Tenants and generations
    are not in the buffers: they are the records' (`layout`), page by page. None when the buffers read or
    write other pages than the records: the fence tells one tenant's pages from another's (mid_decode gives
    each row its own), not one row's pages in another order."""
    rows, page_size = layout.tenants.size, graphs.pool.page_size
    _, positions, slots, lens = graphs.packed[:, :rows].cpu().numpy()
    tables = graphs.tables[:rows].cpu().numpy()
    counts = cdiv(lens, page_size)
    pages = np.concatenate([tables[row, :count] for row, count in enumerate(counts)])
    same = np.array_equal(pages, layout.pages) and np.array_equal(slots // page_size, layout.write_pages)
    if not same:
        return None
    return StepLayout.of(
        tenants=layout.tenants,
        num_cached=lens - 1,  # a decode row attends over its cached tokens and the one it feeds
        starts=np.concatenate([[0], np.cumsum(counts)]),
        pages=pages,
        generations=layout.generations,
        write_rows=np.arange(rows),
        write_pages=slots // page_size,
        write_generations=layout.write_generations,
        write_offsets=slots % page_size,
        write_positions=positions,
    )


def padding_in_scratch(graphs: DecodeGraphRunner, rows: int, bucket: int) -> bool:
    """At least one padding row, and the padding rows' table and write slot name only the scratch page (no
    metadata, so the fence cannot speak for it)."""
    scratch, page_size = graphs.scratch_page, graphs.pool.page_size
    tables = graphs.tables[rows:bucket].cpu().numpy()
    slots = graphs.packed[2, rows:bucket].cpu().numpy()
    return bucket > rows and bool((tables == scratch).all() and (slots // page_size == scratch).all())


def hf_tok_s(
    hf: torch.nn.Module, prompts: list[list[int]], max_tokens: int, batch: int, device: str
) -> float:
    """HF generate() over equal-length prompts in batches of `batch`, back to back: output tokens/s."""
    started = time.perf_counter()
    for first in range(0, len(prompts), batch):
        ids = torch.tensor(prompts[first : first + batch], device=device)
        with torch.inference_mode():
            hf.generate(input_ids=ids, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens)
    sync(device)
    return len(prompts) * max_tokens / (time.perf_counter() - started)


def w1_rows(gguf: GGUFModel, model: Transformer, hf: torch.nn.Module, device: str, quick: bool) -> list[Row]:
    requests, max_tokens, levels = (16, 16, (4, 16)) if quick else (256, W1.max_tokens, (64, 256))
    rows = []
    for concurrency in levels:
        pages = concurrency * cdiv(W1.prompt_len + max_tokens, 16) + 16
        window = W1.prompt_len + max_tokens
        engine = engine_on(gguf, model, max_num_seqs=concurrency, num_pages=pages, max_model_len=window)
        assert engine.tokenizer is not None
        prompts = make_prompts(engine.tokenizer, requests, W1.prompt_len, salt=concurrency)
        ours = run_kvfence(engine, prompts, max_tokens, concurrency)
        theirs = hf_tok_s(hf, prompts, max_tokens, concurrency, device)
        fence = ours.fence_s / ours.step_s if ours.step_s else 0.0
        rows.append(
            (
                f"W1 c{concurrency} ({requests} req, {max_tokens} out)",
                f"{ours.tok_per_s:,.0f} tok/s",
                f"HF batch {concurrency}: {theirs:,.0f} tok/s, ratio {ours.tok_per_s / theirs:.2f}x; "
                f"fence {fence * 100:.2f}% of step time, {ours.step_s / ours.steps * 1e3:.1f} ms/step",
            )
        )
    return rows


def server_rows(device: str, tokenizer: Tokenizer, quick: bool) -> list[Row]:
    """TPOT through a `kvfence serve` process on `device`, and on CUDA through one with `--enforce-eager`
    after it (the graphs' gain, in the same run)."""
    modes = [("", [])] + ([(" eager", ["--enforce-eager"])] if device.startswith("cuda") else [])
    return [row for label, flags in modes for row in server_mode_rows(device, tokenizer, quick, label, flags)]


def server_mode_rows(
    device: str, tokenizer: Tokenizer, quick: bool, label: str, flags: list[str]
) -> list[Row]:
    """W1 prompts streamed at each of SERVER_CLIENTS concurrent clients to a server started with `flags`
    (bench/disagg.py's client: TPOT = (last chunk - first text chunk) / (tokens - 1))."""
    if importlib.util.find_spec("uvicorn") is None:
        return [(f"server{label} TPOT", "skipped", "uvicorn missing: `kvfence serve` cannot start")]
    from kvfence.harness.cluster import cluster  # needs uvicorn

    waves, max_tokens = (1, 16) if quick else (4, W1.max_tokens)
    window = W1.prompt_len + max_tokens
    args = ["--device", device, "--max-num-seqs", str(max(SERVER_CLIENTS)), "--max-model-len", str(window)]
    stack = contextlib.ExitStack()
    try:
        url = stack.enter_context(cluster(serve_args=[*args, *flags])).url
    except RuntimeError as error:  # it exited or never answered /health: what happened, its last line why
        lines = str(error).strip().splitlines()
        why = " ".join(dict.fromkeys((lines[0], lines[-1].strip())))
        return [(f"server{label} TPOT", "skipped", f"`kvfence serve` did not start: {why}")]
    with stack:
        # A warm-up: the server's one-off allocations are not measured.
        tpot_row(url, tokenizer, 4, 4, 4, label)
        return [
            tpot_row(url, tokenizer, clients, clients * waves, max_tokens, label)
            for clients in SERVER_CLIENTS
        ]


def tpot_row(
    url: str, tokenizer: Tokenizer, clients: int, requests: int, max_tokens: int, label: str = ""
) -> Row:
    """`requests` fresh W1 prompts streamed by `clients` concurrent clients: TPOT p50 and p95."""
    prompts = make_prompts(tokenizer, requests, W1.prompt_len, salt=100 + clients)
    _, timings, wall = run_streams(url, prompts, max_tokens, clients)
    result = RunResult("server", clients, len(timings), wall, len(timings) * max_tokens, timings)
    return (
        f"server{label} TPOT c{clients} ({requests} req, {max_tokens} out)",
        f"p50 {result.pct('tpot', 50) * 1e3:.2f} ms",
        f"p95 {result.pct('tpot', 95) * 1e3:.2f} ms; {result.tok_per_s:,.0f} out tok/s",
    )


def main() -> int:
    args = parse_args()
    started = time.perf_counter()
    gguf = load_weights()
    device_gguf = gguf if args.device == "cpu" else load_gguf_on(gguf, args.device)
    model = Transformer.from_gguf(device_gguf)
    hf = load_hf_model(gguf).to(args.device)
    tokenizer = Tokenizer.from_gguf(gguf)
    rows: list[Row] = []
    sections: list[tuple[str, Callable[[], list[Row]]]] = [
        ("golden", lambda: golden_rows(device_gguf, model, hf, args.device, 8 if args.quick else 24)),
        ("faults", lambda: fault_rows(model)),
        ("graphs", lambda: graph_rows(device_gguf, model, args.device, 4 if args.quick else 64)),
        ("W1", lambda: w1_rows(device_gguf, model, hf, args.device, args.quick)),
        ("server", lambda: server_rows(args.device, tokenizer, args.quick)),
    ]
    for name, section in sections:
        section_started = time.perf_counter()
        try:
            rows += section()
        except Exception as error:  # one broken section must not hide the others' results
            VERDICTS.record(f"{name} section", False)
            rows.append((name, "ERROR", f"{type(error).__name__}: {error}"))
        print(f"{name}: {time.perf_counter() - section_started:.1f}s", flush=True)
    print_table(("check", "result", "detail"), rows)
    seconds = time.perf_counter() - started
    print(f"{args.device}: {seconds:.0f}s")
    payload = {"device": args.device, "quick": args.quick, "seconds": seconds, "rows": rows}
    if torch.cuda.is_available():
        payload["gpu"] = torch.cuda.get_device_name()
    write_json("gpu", payload)
    return exit_status()


def load_gguf_on(gguf: GGUFModel, device: str) -> GGUFModel:
    from kvfence.model.gguf import load_gguf

    return load_gguf(gguf.path, device=device)


if __name__ == "__main__":
    sys.exit(main())
