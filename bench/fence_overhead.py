"""What isolation costs: W1 with the fence on and off, interleaved ABBA, at concurrency 1, 4 and 16.

    .venv/bin/python bench/fence_overhead.py [--pairs N] [--quick] [--waves K] [--concurrency 1,4,16]
                                             [--retries N] [--threads N] [--speculative-config JSON]

Both engines are built once over one shared Transformer (same weights, same memory) and the runs alternate
on, off, off, on, on, off, ...: which run of a pair goes first alternates too. Every pair gets a fresh
prompt set (same prompts for its on and off run), so no run hits the prefix cache an earlier run filled.
Per concurrency it reports
  * throughput ratio on/off (output tok/s): median and min-max across pairs;
  * p95 ratio on/off of per-request END-TO-END latency (arrival to last token): median and min-max;
  * validation share: fence.stats.seconds / summed engine.step() wall time, over the isolation-on runs.
To fit the time budget a run is `waves` full waves of requests: max(2, C) * waves requests of W1's shape
(64 prompt tokens, 128 output tokens), not all 32. Each pair waits for a quiet machine and is redone
(up to --retries) when other processes took cores it needed (over 15% of the CPUs beyond those torch
leaves idle): on this shared 2-core machine such contention slows torch steps by up to 10x and would
swamp a 0.5% effect. Torch runs with one thread unless --threads says otherwise (see --help).
Writes bench/results/fence_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from common import (
    DEFAULT_THREADS,
    THREADS_HELP,
    W1,
    RunResult,
    Workload,
    build_engine,
    exit_status,
    load_weights,
    make_prompts,
    median_min_max,
    quietly,
    run_kvfence,
    verdict,
    warm_up,
    write_json,
)

from kvfence.config import SpeculativeConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.tables import print_table
from kvfence.model.tokenizer import Tokenizer
from kvfence.model.transformer import Transformer

MAX_OVERHEAD = 0.005  # throughput lost with isolation on
MAX_VALIDATION_SHARE = 0.003  # of step time
HEADERS = (
    "conc",
    "reqs",
    "pairs",
    "redone",
    "tok/s on",
    "tok/s off",
    "tput on/off med",
    "min-max",
    "e2e p95 on/off med",
    "min-max",
    "valid. share %",
    "us/check",
)


@dataclass
class Pair:
    on: RunResult
    off: RunResult

    @property
    def throughput_ratio(self) -> float:
        return self.on.tok_per_s / self.off.tok_per_s

    @property
    def p95_ratio(self) -> float:
        return self.on.pct("latency", 95) / self.off.pct("latency", 95)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=5, help="on/off pairs per concurrency (default 5)")
    parser.add_argument("--waves", type=int, default=1, help="request waves per run (default 1)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--retries", type=int, default=2, help="reruns of a pair run on a busy machine")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 pairs, 32 output tokens")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS, help=THREADS_HELP)
    parser.add_argument(
        "--speculative-config",
        type=lambda text: SpeculativeConfig.from_dict(json.loads(text)),
        help="both engines speculate (vLLM's JSON); the fence's share then includes draft rollbacks",
    )
    return parser.parse_args()


def run_pairs(
    engines: dict[bool, LLMEngine],
    tokenizer: Tokenizer,
    workload: Workload,
    concurrency: int,
    pairs: int,
    retries: int,
) -> tuple[list[Pair], int]:
    """`pairs` on/off pairs; a pair run while others took our cores is redone."""
    done, discarded = [], 0
    for index in range(pairs):
        prompts = make_prompts(
            tokenizer, workload.num_requests, workload.prompt_len, salt=concurrency * 1000 + index
        )

        def run_pair(prompts: list[list[int]] = prompts, on_first: bool = index % 2 == 0) -> Pair:
            # The order alternates: whichever run goes second meets the heap and caches the first left,
            # and a fixed order puts that difference into every ratio.
            runs = {
                on: run_kvfence(engines[on], prompts, workload.max_tokens, concurrency, "on" if on else "off")
                for on in ((True, False) if on_first else (False, True))
            }
            return Pair(runs[True], runs[False])

        pair, dropped = quietly(run_pair, lambda p: max(p.on.foreign_cpu, p.off.foreign_cpu), retries)
        done.append(pair)
        discarded += dropped
        print(
            f"  c{concurrency} pair {index + 1}/{pairs}: on {pair.on.tok_per_s:.2f} tok/s, "
            f"off {pair.off.tok_per_s:.2f} tok/s, ratio {pair.throughput_ratio:.4f}, "
            f"validation {share(pair.on) * 100:.3f}%, others {pair.on.foreign_cpu * 100:.0f}/"
            f"{pair.off.foreign_cpu * 100:.0f}%",
            flush=True,
        )
    return done, discarded


def share(result: RunResult) -> float:
    return result.fence_s / result.step_s


def summarise(concurrency: int, pairs: list[Pair], discarded: int) -> dict[str, Any]:
    on_runs = [p.on for p in pairs]
    checks = sum(r.steps for r in on_runs)
    return {
        "concurrency": concurrency,
        "num_requests": on_runs[0].num_requests,
        "pairs": len(pairs),
        "discarded_pairs": discarded,
        "max_foreign_cpu": max(max(p.on.foreign_cpu, p.off.foreign_cpu) for p in pairs),
        "tok_per_s_on_median": median_min_max([p.on.tok_per_s for p in pairs])[0],
        "tok_per_s_off_median": median_min_max([p.off.tok_per_s for p in pairs])[0],
        "throughput_ratio": median_min_max([p.throughput_ratio for p in pairs]),
        "e2e_p95_ratio": median_min_max([p.p95_ratio for p in pairs]),
        "tpot_p95_ratio": median_min_max([p.on.pct("tpot", 95) / p.off.pct("tpot", 95) for p in pairs]),
        "validation_share": sum(r.fence_s for r in on_runs) / sum(r.step_s for r in on_runs),
        "validation_share_per_run": [share(r) for r in on_runs],
        "us_per_check": sum(r.fence_s for r in on_runs) / checks * 1e6,
        "runs": [{"on": p.on.summary(), "off": p.off.summary()} for p in pairs],
    }


def table_row(s: dict[str, Any]) -> list[object]:
    tput, p95 = s["throughput_ratio"], s["e2e_p95_ratio"]
    return [
        s["concurrency"],
        s["num_requests"],
        s["pairs"],
        s["discarded_pairs"],
        s["tok_per_s_on_median"],
        s["tok_per_s_off_median"],
        f"{tput[0]:.4f}",
        f"{tput[1]:.4f}-{tput[2]:.4f}",
        f"{p95[0]:.4f}",
        f"{p95[1]:.4f}-{p95[2]:.4f}",
        f"{s['validation_share'] * 100:.3f}",
        f"{s['us_per_check']:.0f}",
    ]


def verdicts(s: dict[str, Any]) -> list[str]:
    c, (tput, low, high) = s["concurrency"], s["throughput_ratio"]
    overhead, noise = 1 - tput, (high - low) / 2
    unresolved = f"; pair-to-pair noise ±{noise * 100:.1f}% cannot resolve it" if noise > MAX_OVERHEAD else ""
    return [
        verdict(
            f"c{c} isolation overhead",
            overhead <= MAX_OVERHEAD,
            f"{overhead * 100:+.2f}% throughput (median on/off {tput:.4f}, pairs {low:.4f}-{high:.4f}; "
            f"target <= {MAX_OVERHEAD * 100:.1f}%{unresolved})",
        ),
        verdict(
            f"c{c} validation share",
            s["validation_share"] <= MAX_VALIDATION_SHARE,
            f"{s['validation_share'] * 100:.3f}% of step time (target <= {MAX_VALIDATION_SHARE * 100:.1f}%)",
        ),
    ]


def main() -> int:
    args = parse_args()
    pairs = 2 if args.quick and args.pairs == 5 else args.pairs
    base = Workload(W1.name, W1.num_requests, W1.prompt_len, 32 if args.quick else W1.max_tokens)
    gguf = load_weights(args.threads)
    tokenizer = Tokenizer.from_gguf(gguf)
    model = Transformer.from_gguf(gguf)
    engines = {
        isolation: build_engine(gguf, isolation, model=model, speculative=args.speculative_config)
        for isolation in (True, False)
    }
    for engine in engines.values():
        warm_up(engine, tokenizer)
    summaries = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        workload = base.scaled(max(2, concurrency) * args.waves)
        print(f"{workload} at concurrency {concurrency}", flush=True)
        done, discarded = run_pairs(engines, tokenizer, workload, concurrency, pairs, args.retries)
        summaries.append(summarise(concurrency, done, discarded))
    print("\nisolation on vs off, ABBA. p95 column: per-request end-to-end latency (arrival to last token).")
    print("valid. share: fence.stats.seconds / summed engine.step() time over the isolation-on runs.")
    print_table(HEADERS, [table_row(s) for s in summaries])
    lines = [line for s in summaries for line in verdicts(s)]
    write_json(
        "fence_overhead", {"quick": args.quick, "workload": base, "summaries": summaries, "verdicts": lines}
    )
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
