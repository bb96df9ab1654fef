"""The C prefill-attention kernel, float32 against bf16 (AVX512-BF16), in one run, side by side.

    .venv/bin/python bench/prefill_attention.py [--tokens 512,2000,6000] [--ttft-tokens 6000]
        [--repeats 5] [--threads N]

First the kernel alone: one whole prompt's attention (SmolLM2-135M's shape: 9 heads, 3 kv heads, head_dim
64; a float16 pool) per call, each build's best over --repeats rounds that call every build in turn. Then
end to end: TTFT of one --ttft-tokens prompt (one output token, kvfence's defaults, no prefix caching) on an
engine per build over the same SmolLM2 weights, interleaved the same way (0 skips it). The float32 build
is what KVFENCE_PREFILL_F32=1 runs. Prints the load average before and after each part. Writes
bench/results/prefill_attention.json.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
from common import DEFAULT_THREADS, THREADS_HELP, write_json

from kvfence.harness.hf_prefill import interleaved_best, ttft_run
from kvfence.harness.offline_engine import load_weights
from kvfence.harness.prefill_attention import BUILDS, engines_by_build, kernel_run
from kvfence.harness.tables import print_table
from kvfence.model import paged_kernel


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="512,2000,6000")
    parser.add_argument("--ttft-tokens", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    return parser.parse_args()


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def rows_of(tokens: int, best: dict[str, float], before: str) -> list[list[Any]]:
    return [
        [tokens, name, f"{best[name] * 1e3:.1f}", f"{best['f32'] / best[name]:.2f}", before, load()]
        for name in BUILDS
    ]


def main() -> None:
    args = parse_args()
    if not paged_kernel.bf16_prefill():
        raise SystemExit("this CPU has no AVX512-BF16 (or KVFENCE_PREFILL_F32=1): nothing to compare")
    torch.set_num_threads(args.threads)
    table, results = [], []
    for tokens in map(int, args.tokens.split(",")):
        before = load()
        runs = {name: kernel_run(bf16, tokens) for name, bf16 in BUILDS.items()}
        best = interleaved_best(runs, args.repeats)
        table += rows_of(tokens, best, before)
        results.append(
            {"part": "kernel", "tokens": tokens, "seconds": best, "load_before": before, "load_after": load()}
        )
    if args.ttft_tokens:
        engines = engines_by_build(load_weights(), max_model_len=args.ttft_tokens + 16)
        before = load()
        runs = {
            name: ttft_run(engine, args.ttft_tokens, args.repeats + 1) for name, engine in engines.items()
        }
        best = interleaved_best(runs, args.repeats)
        table += rows_of(args.ttft_tokens, {name: best[name] for name in BUILDS}, before)
        table[-1][0] = table[-2][0] = f"TTFT {args.ttft_tokens}"
        results.append(
            {
                "part": "ttft",
                "tokens": args.ttft_tokens,
                "seconds": best,
                "load_before": before,
                "load_after": load(),
            }
        )
    print_table(["tokens", "build", "ms", "x f32", "load before", "load after"], table)
    write_json("prefill_attention", {"threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
