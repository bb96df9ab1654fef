"""Where a kvfence step spends its time: W1 at concurrency 16, steady-state decode steps.

    .venv/bin/python bench/profile_step.py [--steps 20] [--concurrency 16] [--warm-steps 8]

Admits `concurrency` W1 requests (64 prompt tokens, 128 output), runs the prefill and `warm-steps` decode
steps unprofiled, then profiles `steps` decode steps twice: cProfile (Python functions, file:function, share
of profiled step wall time) and torch.profiler (aten ops, share of self CPU time). Writes
bench/results/profile_step.json.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path
from typing import Any

from common import (
    DEFAULT_THREADS,
    THREADS_HELP,
    W1,
    build_engine,
    load_weights,
    make_prompts,
    wait_for_quiet,
    write_json,
)
from torch.profiler import ProfilerActivity, profile

from kvfence.engine.engine import LLMEngine
from kvfence.harness.tables import print_table
from kvfence.sampling import SamplingParams

REPO = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warm-steps", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    return parser.parse_args()


def start_batch(engine: LLMEngine, concurrency: int, warm_steps: int, salt: int) -> None:
    """Admit a fresh W1 batch and step through its prefill and a few decode steps."""
    assert engine.tokenizer is not None
    params = SamplingParams(max_tokens=W1.max_tokens, ignore_eos=True)
    for prompt in make_prompts(engine.tokenizer, concurrency, W1.prompt_len, salt=salt):
        engine.add_request(prompt, params)
    for _ in range(1 + warm_steps):
        engine.step()


def timed_steps(engine: LLMEngine, steps: int) -> float:
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - started


def where(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    path = Path(filename)
    if path.is_absolute() and REPO in path.parents:
        return f"{path.relative_to(REPO)}:{function}"
    if filename == "~":
        return function  # a C builtin, e.g. <method 'index_copy_' of 'torch._C.TensorBase' objects>
    return f"{path.name}:{line}:{function}"


def python_profile(engine: LLMEngine, steps: int, top: int) -> dict[str, Any]:
    profiler = cProfile.Profile()
    profiler.enable()
    wall = timed_steps(engine, steps)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    rows = [
        {"where": where(key), "calls": nc, "self_s": tt, "cum_s": ct}
        for key, (_cc, nc, tt, ct, _callers) in stats.items()
    ]
    by_self = sorted(rows, key=lambda r: -r["self_s"])[:top]
    ours = sorted((r for r in rows if r["where"].startswith("kvfence/")), key=lambda r: -r["cum_s"])[:top]
    tables = (("self time (cProfile)", by_self, "self_s"), ("kvfence functions, cumulative", ours, "cum_s"))
    for title, table, key in tables:
        print(f"\n{title}: {steps} steps, {wall * 1e3 / steps:.1f} ms/step under cProfile")
        print_table(
            ("where", "calls/step", "ms/step", "share %"),
            [(r["where"][:90], r["calls"] / steps, r[key] * 1e3 / steps, r[key] / wall * 100) for r in table],
        )
    return {"wall_s": wall, "steps": steps, "by_self": by_self, "kvfence_cumulative": ours}


def op_profile(engine: LLMEngine, steps: int, top: int) -> dict[str, Any]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = timed_steps(engine, steps)
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [
        {
            "op": e.key,
            "calls": e.count,
            "self_us": e.self_cpu_time_total,
            "share": e.self_cpu_time_total / total,
        }
        for e in events[:top]
    ]
    print(f"\naten ops (torch.profiler): {steps} steps, {wall * 1e3 / steps:.1f} ms/step under the profiler")
    print_table(
        ("op", "calls/step", "ms/step", "share of op time %"),
        [(r["op"][:60], r["calls"] / steps, r["self_us"] / 1e3 / steps, r["share"] * 100) for r in rows],
    )
    return {"wall_s": wall, "steps": steps, "ops": rows}


def main() -> None:
    args = parse_args()
    engine = build_engine(load_weights(args.threads))
    start_batch(engine, args.concurrency, args.warm_steps, salt=7)
    wait_for_quiet()
    plain = timed_steps(engine, args.steps)
    print(f"unprofiled: {plain * 1e3 / args.steps:.1f} ms/step at concurrency {args.concurrency}")
    fence = engine.fence.stats
    payload: dict[str, Any] = {"concurrency": args.concurrency, "plain_ms_per_step": plain * 1e3 / args.steps}
    payload["python"] = python_profile(engine, args.steps, args.top)
    payload["fence_us_per_check"] = fence.seconds / fence.checks * 1e6
    # A fresh batch so the op profile sees the same context lengths as the cProfile run.
    while engine.has_unfinished():
        engine.step()
    start_batch(engine, args.concurrency, args.warm_steps + args.steps, salt=8)
    payload["ops"] = op_profile(engine, args.steps, args.top)
    write_json("profile_step", payload)


if __name__ == "__main__":
    main()
