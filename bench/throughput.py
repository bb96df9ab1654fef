"""Offline throughput: kvfence at concurrency 1/4/16 against HF transformers generate() at batch 1/16.

    .venv/bin/python bench/throughput.py [--quick] [--workloads W1,W2] [--requests N]
                                         [--sequential-requests N] [--retries N] [--threads N]
                                         [--model FILE|smollm2|gemma3-270m] [--no-hf]

`--model` serves another GGUF or a Hugging Face directory (HF loads the same file or directory;
`--no-hf` leaves HF out, and the c16 ratio's verdict with it). Before the workloads, the decode matmul's
GB/s at one row (every projection once, as a decode step reads them: packed codes, or 16-bit weights) is
set beside the machine's measured read bandwidth at 1 and at --threads threads.

W1 is decode-heavy (64 prompt tokens, 128 output tokens), W2 prefill-heavy (512 prompt, 16 output); both
32 distinct prompts. Every system gets the same token ids and produces exactly max_tokens tokens (greedy,
ignore_eos / min_new_tokens). Rows at concurrency / batch 1 run one request at a time, so their per-token
numbers do not depend on the request count: they use the first `--sequential-requests` prompts (default 8)
to fit the time budget. Each row waits for a quiet machine and is redone (up to --retries) when other
processes took cores it needed (over 15% of the CPUs beyond those torch leaves idle); the "others %" column
shows what they took. Torch runs with two threads unless --threads says otherwise (kvfence and HF alike;
see --help for when one is better).
Writes bench/results/throughput.json.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from common import (
    DEFAULT_THREADS,
    RUN_HEADERS,
    THREADS_HELP,
    WORKLOADS,
    RunResult,
    Workload,
    build_engine,
    contention_threshold,
    decode_matmul_bandwidth,
    exit_status,
    load_hf_model,
    load_weights,
    make_prompts,
    quietly,
    read_bandwidth,
    run_cells,
    run_hf,
    run_kvfence,
    verdict,
    warm_up,
    write_json,
)

from kvfence.cli_options import model_file
from kvfence.harness.tables import print_table
from kvfence.model.gguf import GGUFModel
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer

ROWS = (("kvfence", 1), ("kvfence", 4), ("kvfence", 16), ("hf", 1), ("hf", 16))  # system, concurrency/batch
# Run order: the rows compared with each other back to back, so they see the same machine weather.
RUN_ORDER = (("kvfence", 16), ("hf", 16), ("kvfence", 1), ("hf", 1), ("kvfence", 4))
TARGETS = {"W1": 2.0, "W2": 1.2}  # kvfence c16 / HF b16 output tok/s
HEADERS = ("workload", *RUN_HEADERS)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 requests per workload")
    parser.add_argument("--workloads", default="W1,W2", help="comma-separated subset of W1,W2")
    parser.add_argument("--requests", type=int, default=None, help="override the request count (32)")
    parser.add_argument("--sequential-requests", type=int, default=8, help="requests for conc/batch 1 rows")
    parser.add_argument("--retries", type=int, default=1, help="reruns of a row run on a busy machine")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    parser.add_argument(
        "--model",
        type=model_file,
        help="GGUF file, Hugging Face directory or packaged name (default: smollm2)",
    )
    parser.add_argument("--no-hf", action="store_true", help="kvfence rows only (no transformers model)")
    return parser.parse_args()


class Bench:
    """The loaded weights, the HF model and the tokenizer, shared by every row."""

    def __init__(self, threads: int, path: Path | None, hf: bool) -> None:
        self.gguf: GGUFModel = load_weights(threads, path)
        self.model = Transformer.from_gguf(self.gguf)  # holds no per-engine state: one for every engine
        self.tokenizer = Tokenizer.from_gguf(self.gguf)
        self.hf_model: torch.nn.Module | None = load_hf_model(self.gguf) if hf else None
        self.pad_id = self.tokenizer.eos_token_id
        if self.hf_model is not None:  # warm-up
            run_hf(self.hf_model, make_prompts(self.tokenizer, 2, 48, salt=-1), 4, 2, self.pad_id)
        self.rows = [(system, width) for system, width in RUN_ORDER if hf or system != "hf"]

    def runner(
        self, system: str, width: int, prompts: list[list[int]], max_tokens: int
    ) -> Callable[[], RunResult]:
        if system == "hf":
            assert self.hf_model is not None
            hf_model = self.hf_model
            return lambda: run_hf(hf_model, prompts, max_tokens, width, self.pad_id)

        def run() -> RunResult:
            engine = build_engine(self.gguf, model=self.model)  # fresh: an empty prefix cache
            warm_up(engine, self.tokenizer)
            return run_kvfence(engine, prompts, max_tokens, width)

        return run


def run_workload(bench: Bench, workload: Workload, sequential: int, retries: int) -> list[RunResult]:
    prompts = make_prompts(bench.tokenizer, workload.num_requests, workload.prompt_len)
    results = []
    for system, width in bench.rows:
        subset = prompts[:sequential] if width == 1 else prompts
        run = bench.runner(system, width, subset, workload.max_tokens)
        result, discarded = quietly(run, lambda r: r.foreign_cpu, retries)
        results.append(result)
        print(
            f"  {system} x{width}: {result.tok_per_s:.2f} tok/s in {result.wall_s:.1f}s "
            f"(others {result.foreign_cpu * 100:.0f}%, {discarded} discarded)",
            flush=True,
        )
    return sorted(results, key=lambda r: ROWS.index((r.label, r.concurrency)))


def row(workload: Workload, result: RunResult) -> list[object]:
    return [workload.name, *run_cells(result)]


def c16_ratio(results: list[RunResult]) -> float:
    def find(label: str) -> RunResult:
        return next(r for r in results if r.label == label and r.concurrency == 16)

    return find("kvfence").tok_per_s / find("hf").tok_per_s


def bandwidth(bench: Bench, threads: int) -> dict[str, float]:
    """The decode matmul's GB/s at one row beside the machine's read bandwidth, printed and returned."""
    one, many = read_bandwidth(1), read_bandwidth(threads)
    matmul_one, mb = decode_matmul_bandwidth(bench.model, 1)
    matmul_many, _ = decode_matmul_bandwidth(bench.model, threads)
    print_table(
        ("threads", "memory read GB/s", "decode matmul GB/s (1 row)", "matmul / memory"),
        [
            [n, f"{memory:.1f}", f"{matmul:.1f}", f"{matmul / memory:.0%}"]
            for n, memory, matmul in ((1, one, matmul_one), (threads, many, matmul_many))
        ],
    )
    print(f"(the decode matmul reads {mb:.0f} MB a step: every projection's weights as stored)")
    return {
        "memory_read_gb_s_1_thread": one,
        f"memory_read_gb_s_{threads}_threads": many,
        "decode_matmul_gb_s_1_thread": matmul_one,
        f"decode_matmul_gb_s_{threads}_threads": matmul_many,
        "decode_matmul_mb_per_step": mb,
    }


def main() -> int:
    args = parse_args()
    bench = Bench(args.threads, args.model, hf=not args.no_hf)
    count = args.requests or (4 if args.quick else None)
    sequential = min(args.sequential_requests, count or args.sequential_requests)
    paths = {"decode_attention": bench.model.decode_attention, "decode_matmul": bench.model.decode_matmul}
    print(f"kvfence decode paths: {paths}")
    payload: dict[str, object] = {
        "model": bench.gguf.path.name,
        "architecture": bench.model.config.architecture,
        "quantization": bench.model.quantization,
        "bandwidth": bandwidth(bench, args.threads),
        "quick": args.quick,
        "hf_ttft": "timing streamer in the same generate()",
        "kvfence_decode_paths": paths,
    }
    table, ratios = [], {}
    for name in args.workloads.split(","):
        workload = WORKLOADS[name.strip()]
        workload = workload.scaled(count) if count else workload
        print(f"{workload}", flush=True)
        results = run_workload(bench, workload, sequential, args.retries)
        table += [row(workload, r) for r in results]
        payload[workload.name] = {"workload": workload, "runs": [r.summary() for r in results]}
        if bench.hf_model is not None:
            ratios[workload.name] = c16_ratio(results)
            payload[workload.name] |= {  # type: ignore[operator]
                "ratio_kvfence_c16_over_hf_b16": ratios[workload.name],
                "target": TARGETS[workload.name],
            }
    print("\nms columns. TTFT: arrival (add_request / the batch's generate() call) to first token.")
    print(
        "TPOT: mean time per output token after the first. HF TTFT: timing streamer in the same generate()."
    )
    print(
        f"others %: CPU share other processes took during the row "
        f"(contended above {contention_threshold():.0%} with {torch.get_num_threads()} torch thread(s))."
    )
    print_table(HEADERS, table)
    payload["verdicts"] = [
        verdict(
            f"{name} kvfence c16 / HF b16 output tok/s",
            ratio >= TARGETS[name],
            f"{ratio:.2f}x (target >= {TARGETS[name]:.1f}x)",
        )
        for name, ratio in ratios.items()
    ]
    write_json("throughput" if args.model is None else f"throughput-{bench.gguf.path.stem}", payload)
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
