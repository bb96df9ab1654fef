"""Load with faults: many concurrent clients of several tenants against the real server, with client
cancellations mid-stream and fault injection, single node and disaggregated (Router + worker processes).

    .venv/bin/python bench/stress.py [--mode single|disagg|both] [--clients 64] [--requests 256]
                                     [--tenants 4] [--cancel-rate 0.2] [--fault-scale 1.0]
                                     [--time-limit 900] [--seed 0]

Every prompt is token ids of exact length: short ones, ones on page boundaries, ones exactly at the
context window (prompt + max_tokens == window: must complete) and just beyond it (must be refused with
400 before anything is reserved). Each tenant's prompts start with its own canary. Every request is
greedy with ignore_eos and a fixed max_tokens, so its output is fully determined by its prompt. The load
generator, the runs and their rules live in kvfence/harness (load.py, runs.py, judge.py), shared with
tests/integration/test_stress.py; this script runs them at full size, prints the tables and writes JSON.

At the end it reports and checks (RunReport.problems lists every rule broken): every completed request
equals its solo reference (computed offline by a separate engine; a divergence is accepted only at a
near-tie of the reference's top-2 logits, as in the golden tests); every other request ended with a clear
error (400 rejection, 500 kv_integrity_error, 503 retry-later: retried after a pause, up to RETRY_ATTEMPTS
times) or the client's own cancellation; no tenant's canary in another tenant's output; every fault that
took effect was caught (single node: see kvfence/harness/ledger.py; the disaggregated run counts what the
audit trails show); after the drain every page is free or cached with no reference, nothing quarantined, the
allocator consistent; and /health answered throughout. Prints a table and writes
bench/results/stress.json. Loopback only; the load is bounded by --requests and --time-limit. One torch
thread by default (--threads): clients, server and engine share this process, and OpenMP threads spinning
against them (or anything else on a 2-core machine) slowed steps by up to 10x here.
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import asdict
from typing import Any

import torch
from common import load_weights, write_json

from kvfence.harness.judge import RunReport, print_report
from kvfence.harness.references import reference_engine
from kvfence.harness.runs import Plan, run_disaggregated, run_single_node


def report_json(report: RunReport) -> dict[str, Any]:
    return {
        "mode": report.mode,
        "wall_s": report.wall_s,
        "counts": dict(report.counts()),
        "matches": dict(Counter(o.match for o in report.outcomes if o.match)),
        "health": asdict(report.health),
        "drain": report.drain,
        "faults": report.faults,
        "leaks": report.leaks,
        "problems": report.problems,
        "outcomes": [asdict(o) for o in report.outcomes],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["single", "disagg", "both"], default="both")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--tenants", type=int, default=4)
    parser.add_argument("--window", type=int, default=512, help="max_model_len of every engine")
    parser.add_argument("--num-pages", type=int, default=128, help="pages per pool (16 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens a job asks for")
    parser.add_argument("--cancel-rate", type=float, default=0.2)
    parser.add_argument("--fault-scale", type=float, default=1.0, help="multiplies every fault rate; 0: off")
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds of load per mode, at most")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in this process (see below)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan = Plan(
        args.clients,
        args.requests,
        args.tenants,
        args.window,
        args.num_pages,
        args.max_tokens,
        args.cancel_rate,
        args.fault_scale,
        args.time_limit,
        args.seed,
    )
    gguf = load_weights()
    refs_engine = reference_engine(gguf, plan.window)
    reports = []
    if args.mode in ("single", "both"):
        reports.append(run_single_node(gguf, plan, refs_engine))
        print_report(reports[-1])
    if args.mode in ("disagg", "both"):
        reports.append(run_disaggregated(gguf, plan, refs_engine))
        print_report(reports[-1])
    write_json("stress", {"plan": asdict(plan), "runs": [report_json(r) for r in reports]})
    raise SystemExit(1 if any(r.problems for r in reports) else 0)


if __name__ == "__main__":
    main()
