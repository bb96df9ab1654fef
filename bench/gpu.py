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
  graphs      a decode step replayed from a captured graph (CUDA; an eager stand-in on CPU) vs the eager
              forward: greedy tokens equal, logits max diff, ms per step; the decode attention in use
  W1          256 requests, 64 prompt / 128 output tokens, greedy, ignore_eos, at concurrency 64 and 256,
              and HF generate() at the same batch sizes in the same run; fence share of step time
  server      TPOT through the HTTP server: skipped (fastapi missing, or not measured by this script)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import W1, build_engine, load_hf_model, load_weights, make_prompts, run_kvfence, write_json

from kvfence.engine.engine import LLMEngine
from kvfence.engine.graphs import CudaGraphBackend, DecodeBatch, DecodeGraphRunner, Replay
from kvfence.engine.runner import build_layout
from kvfence.harness.tables import print_table
from kvfence.model.gguf import GGUFModel
from kvfence.model.llama import LlamaModel
from kvfence.request import Status
from kvfence.sampling import SamplingParams
from kvfence.units import cdiv

REPO = Path(__file__).resolve().parent.parent
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


def engine_on(gguf: GGUFModel, model: LlamaModel, **overrides: Any) -> LLMEngine:
    return build_engine(gguf, model=model, device=str(model.device), **overrides)


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
    gguf: GGUFModel, model: LlamaModel, hf: torch.nn.Module, device: str, tokens: int
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
        ("golden tokens == CPU path", verdict(same_cpu == n), f"{same_cpu}/{n} prompts, {tokens} tokens"),
        ("golden tokens == HF on device", verdict(same_hf == n), f"{same_hf}/{n} prompts, up to EOS"),
        ("batched == solo", verdict(same_solo == n), f"{same_solo}/{n} prompts"),
    ]


def verdict(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def fault_cases(model: LlamaModel) -> types.ModuleType:
    """tests/unit/test_fence_faults.py's scenarios. Its conftest needs fastapi and the tiny model, so a stub
    conftest gives it only `make_engine` over the real model; where pytest is missing, a stub of the one
    decorator the module uses at import."""

    def make_engine(_model: LlamaModel, **overrides: object) -> LLMEngine:
        settings = {"num_pages": 64, "page_size": 4, "max_num_batched_tokens": 64, "max_model_len": 48}
        settings |= {"device": str(model.device)} | overrides
        from kvfence.config import EngineConfig

        return LLMEngine(EngineConfig(**settings), model, log=lambda _: None)  # type: ignore[arg-type]

    sys.modules["conftest"] = types.SimpleNamespace(make_engine=make_engine)  # type: ignore[assignment]
    if importlib.util.find_spec("pytest") is None:
        identity = types.SimpleNamespace(parametrize=lambda *a, **k: lambda f: f)
        sys.modules["pytest"] = types.SimpleNamespace(mark=identity)  # type: ignore[assignment]
    spec = importlib.util.spec_from_file_location("fence_faults", REPO / "tests/unit/test_fence_faults.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
    spec.loader.exec_module(module)
    return module


def fault_rows(model: LlamaModel) -> list[Row]:
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
        rows.append((f"fault {name}", verdict(passed), detail))
    return rows


class EagerBackend:
    """The graph seam on CPU: no capture, the forward runs again on every replay."""

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


def graph_rows(gguf: GGUFModel, model: LlamaModel, device: str, rows: int) -> list[Row]:
    """One decode step of `rows` requests: the graph replay against the eager forward."""
    engine = engine_on(gguf, model, max_num_seqs=rows, num_pages=rows * 6 + 8, max_model_len=80)
    assert engine.tokenizer is not None
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    for prompt in make_prompts(engine.tokenizer, rows, 40, salt=3):
        engine.add_request(prompt, params)
    for _ in range(3):  # prefill, then decode steps
        engine.step()
    backend = CudaGraphBackend() if device == "cuda" else EagerBackend()
    graphs = DecodeGraphRunner(model, engine.pool, rows, max_pages_per_seq=8, backend=backend)
    batch = engine.scheduler.schedule()
    layout = build_layout(batch.requests, batch.num_new_tokens, engine.pool.page_size)
    tokens = torch.tensor([r.all_token_ids[r.num_computed_tokens] for r in batch.requests]).numpy()
    decode = DecodeBatch.from_layout(layout, tokens, engine.pool.page_size)
    inputs, _ = engine.runner._model_inputs(batch.requests, batch.num_new_tokens, layout)
    eager = model.forward(inputs, engine.pool.kv).clone()
    replayed = graphs.run(decode)
    assert replayed is not None
    diff = (replayed - eager).abs().max().item()
    same = bool(torch.equal(replayed.argmax(-1), eager.argmax(-1)))
    eager_s = timed(lambda: model.forward(inputs, engine.pool.kv), device, 10)
    graph_s = timed(lambda: graphs.run(decode), device, 10)
    kind = "CUDA graph" if device == "cuda" else "eager stand-in"
    note = f"({model.decode_attention_note})" if model.decode_attention_note else ""
    return [
        (
            f"graph replay ({kind}), {rows} rows",
            verdict(same),
            f"argmax equal {same}, max |logit diff| {diff:.1e}",
        ),
        (
            f"decode forward {rows} rows",
            f"{graph_s * 1e3:.2f} ms replayed",
            f"{eager_s * 1e3:.2f} ms eager; decode attention {model.decode_attention} {note}",
        ),
    ]


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


def w1_rows(gguf: GGUFModel, model: LlamaModel, hf: torch.nn.Module, device: str, quick: bool) -> list[Row]:
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


def server_rows() -> list[Row]:
    if importlib.util.find_spec("fastapi") is None:
        return [("server TPOT", "skipped", "fastapi missing")]
    return [("server TPOT", "skipped", "not measured by this script yet (fastapi present)")]


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    gguf = load_weights()
    device_gguf = gguf if args.device == "cpu" else load_gguf_on(gguf, args.device)
    model = LlamaModel.from_gguf(device_gguf)
    hf = load_hf_model(gguf).to(args.device)
    rows: list[Row] = []
    sections: list[tuple[str, Callable[[], list[Row]]]] = [
        ("golden", lambda: golden_rows(device_gguf, model, hf, args.device, 8 if args.quick else 24)),
        ("faults", lambda: fault_rows(model)),
        ("graphs", lambda: graph_rows(device_gguf, model, args.device, 4 if args.quick else 64)),
        ("W1", lambda: w1_rows(device_gguf, model, hf, args.device, args.quick)),
        ("server", server_rows),
    ]
    for name, section in sections:
        section_started = time.perf_counter()
        try:
            rows += section()
        except Exception as error:  # one broken section must not hide the others' results
            rows.append((name, "ERROR", f"{type(error).__name__}: {error}"))
        print(f"{name}: {time.perf_counter() - section_started:.1f}s", flush=True)
    print_table(("check", "result", "detail"), rows)
    seconds = time.perf_counter() - started
    print(f"{args.device}: {seconds:.0f}s")
    payload = {"device": args.device, "quick": args.quick, "seconds": seconds, "rows": rows}
    if torch.cuda.is_available():
        payload["gpu"] = torch.cuda.get_device_name()
    write_json("gpu", payload)


def load_gguf_on(gguf: GGUFModel, device: str) -> GGUFModel:
    from kvfence.model.gguf import load_gguf

    return load_gguf(gguf.path, device=device)


if __name__ == "__main__":
    main()
