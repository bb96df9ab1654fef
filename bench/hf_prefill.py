"""Prefill of a Hugging Face directory's 16-bit weights against BLAS over the same weights, in one run.

    .venv/bin/python bench/hf_prefill.py [--source DIR] [--tokens 64,512] [--repeats 5] [--threads N]

From a float32 directory (default: SmolLM2's at ~/.cache/kvfence-peers/vllm/smollm2-hf) writes bfloat16
and float16 copies into a temporary directory. For each prompt length: kvfence's TTFT (one output token,
defaults) over each 16-bit directory and over the float32 one (whose weights kvfence multiplies on BLAS),
and over the bfloat16 one on the exact path too (`--activation-dtype float32`: float32 rows),
and torch's F.linear over every layer's weights at that many rows in float32 and bfloat16 (the matmuls
alone). GFLOPS = 2 x layer weights x tokens / seconds for every row, so the ratios are like for like.
Each row's figure is its best over --repeats rounds that run every row once in turn.
Prints the load average and what other processes took of the CPUs (the machine is shared). Writes
bench/results/hf_prefill.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from common import DEFAULT_THREADS, THREADS_HELP, ForeignCpu, write_json

from kvfence.harness.hf_prefill import (
    engine_for,
    interleaved_best,
    layer_weights,
    linear_run,
    prefill_flops,
    sixteen_bit_dir,
    ttft_run,
)
from kvfence.harness.tables import print_table

SOURCE = Path.home() / ".cache" / "kvfence-peers" / "vllm" / "smollm2-hf"
HEADERS = ["tokens", "row", "ms", "GFLOPS", "x F.linear f32"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", type=Path, default=SOURCE, help="a float32 Hugging Face directory")
    parser.add_argument("--tokens", default="64,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    weights = layer_weights(args.source)
    others, load_before = ForeignCpu(), os.getloadavg()
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"kvfence float32 dir (BLAS)": engine_for(args.source)}
        for name, dtype in (("bf16", torch.bfloat16), ("f16", torch.float16)):
            directory = sixteen_bit_dir(args.source, Path(tmp) / name, dtype)
            engines[f"kvfence {name} dir"] = engine_for(directory)
            if dtype == torch.bfloat16:
                engines["kvfence bf16 dir, float32 rows"] = engine_for(directory, activation_dtype="float32")
        for tokens in (int(t) for t in args.tokens.split(",")):
            runs = {
                "F.linear f32": linear_run(weights, tokens, torch.float32),
                "F.linear bf16": linear_run(weights, tokens, torch.bfloat16),
            }
            runs |= {name: ttft_run(engine, tokens, args.repeats + 1) for name, engine in engines.items()}
            seconds = interleaved_best(runs, args.repeats)
            flops = prefill_flops(weights, tokens)
            for name, s in seconds.items():
                ratio = seconds["F.linear f32"] / s
                rows.append([tokens, name, f"{1e3 * s:.1f}", f"{flops / s / 1e9:.0f}", f"{ratio:.2f}"])
                results.append({"tokens": tokens, "row": name, "seconds": s, "gflops": flops / s / 1e9})
    share = others.share()
    print_table(HEADERS, rows)
    print(f"load average before {load_before}, after {os.getloadavg()}; others took {share:.0%} of the CPUs")
    write_json("hf_prefill", {"rows": results, "load_average": os.getloadavg(), "others_share": share})


if __name__ == "__main__":
    main()
