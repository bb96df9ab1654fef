"""kvfence on Ray Serve: request routers side by side, and 1 vs 2 replicas, in one run on one local cluster.

    .venv/bin/python bench/ray_serve.py [--tenants 6] [--conversations 2] [--turns 5] [--max-tokens 8]
        [--think 0.5] [--replica-cpus 0.5] [--threads 1] [--rounds 2] [--runs kvfence/2,power-of-two/2,...]

A multi-turn, multi-tenant chat workload (kvfence.harness.chat_turns.ChatPlan: every tenant's chats open
with the same system prompt and questions; each turn carries the chat so far, the model's own answers
included; tenants at once, each tenant's turns one after another with a think time between) through Ray's
HTTP proxy and kvfence's front, the real SmolLM2 in every replica, for: kvfence's router, Ray's default
power-of-two router and Ray Serve LLM's PrefixCacheAffinityRouter on 2 replicas, and kvfence's router on 1
replica. Reported per run: the replicas' prefix-cache hit rate (hit tokens / looked-up tokens, from their
/metrics), the share of turns placed on their chat's previous turn's replica, TTFT p50/p95 as the client
sees it, turns/s and content events/s (think times included: the 1 vs 2 replica ratio is of the same
closed workload); the runs go in order, `--rounds` times (load that drifts over the run shows as a
difference between rounds); ratios are of the rounds' means. A tenant's pool pages are its own
(kvfence's prefix cache is tenant-scoped), so a router that steers tenants together wins no hits by it.
Each deployment first takes a few short warm-up requests, not counted. Writes
bench/results/ray_serve.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import write_json

from kvfence.disagg.launch import free_ports
from kvfence.harness.chat_turns import ChatPlan, chat_workload
from kvfence.harness.key_files import write_key_file
from kvfence.harness.tables import print_table
from kvfence.ray.bench import deployed, ray_cluster

RUNS = [("kvfence", 2), ("power-of-two", 2), ("prefix-cache", 2), ("kvfence", 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=ChatPlan.tenants)
    parser.add_argument("--conversations", type=int, default=ChatPlan.conversations)
    parser.add_argument("--turns", type=int, default=ChatPlan.turns)
    parser.add_argument("--max-tokens", type=int, default=ChatPlan.max_tokens)
    parser.add_argument("--think", type=float, default=ChatPlan.think_s, help="mean seconds between turns")
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per replica")
    parser.add_argument("--rounds", type=int, default=2, help="the runs in order, this many times")
    parser.add_argument("--runs", default=",".join(f"{r}/{n}" for r, n in RUNS), help="ROUTER/REPLICAS,...")
    args = parser.parse_args()
    plan = ChatPlan(args.tenants, args.conversations, args.turns, args.max_tokens, args.think)
    directory = Path(tempfile.mkdtemp(prefix="kvfb-"))  # short: Ray's socket paths must fit 107 bytes
    try:
        results = _run_all(directory, plan, args)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    _report(results, plan, args)
    return 0


def _run_all(directory: Path, plan: ChatPlan, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    tenant_keys = [f"sk-{secrets.token_hex(16)}" for _ in range(plan.tenants + 1)]  # the last: warm-ups
    admin_key = f"admin-{secrets.token_hex(16)}"
    keys = write_key_file(directory / "api-keys", [f"{k} tenant-{i}" for i, k in enumerate(tenant_keys)])
    admin = write_key_file(directory / "admin-key", [admin_key])
    serve_args = ["--num-pages", "512", "--max-model-len", "1024", "--num-threads", str(args.threads)]
    serve_args += ["--disable-log-stats", "--api-keys", str(keys), "--admin-key-file", str(admin)]
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    (port,) = free_ports(1)
    results: dict[str, list[dict[str, Any]]] = {}
    with ray_cluster(port, directory / "ray") as url:
        for round_ in range(args.rounds):
            for name in args.runs.split(","):
                router, replicas = name.split("/")[0], int(name.split("/")[1])
                print(f"-- round {round_ + 1}, {name}: deploying", flush=True)
                with deployed(serve_args, replicas, args.replica_cpus, router):
                    outcome = asyncio.run(
                        chat_workload(url, tenant_keys[:-1], admin_key, replicas, plan, tenant_keys[-1])
                    )
                summary = outcome.summary()
                results.setdefault(name, []).append(summary)
                print(f"   { {k: v for k, v in summary.items() if k != 'placements'} }", flush=True)
    return results


def _report(results: dict[str, list[dict[str, Any]]], plan: ChatPlan, args: argparse.Namespace) -> None:
    headers = ["run", "round", "hit rate", "stayed", "TTFT p50 s", "TTFT p95 s", "turns/s", "by replica"]
    fields = ("hit_rate", "turns_on_previous_turns_replica", "ttft_p50_s", "ttft_p95_s", "turns_per_s")
    rows = [
        [name, i + 1, *(r[f] for f in fields), sorted(r["turns_by_replica"].values())]
        for name, rounds in results.items()
        for i, r in enumerate(rounds)
    ]
    print_table(headers, rows)
    mean = {
        name: {f: statistics.fmean(r[f] for r in rounds) for f in fields} for name, rounds in results.items()
    }
    ratios = {}
    ours = mean.get("kvfence/2")
    for other in ("power-of-two/2", "prefix-cache/2"):
        theirs = mean.get(other)
        if ours and theirs:
            ratios[f"hit_rate kvfence/2 - {other}"] = round(ours["hit_rate"] - theirs["hit_rate"], 4)
            ratios[f"ttft_p50 kvfence/2 / {other}"] = _ratio(ours["ttft_p50_s"], theirs["ttft_p50_s"])
            ratios[f"ttft_p95 kvfence/2 / {other}"] = _ratio(ours["ttft_p95_s"], theirs["ttft_p95_s"])
    if ours and "kvfence/1" in mean:
        ratios["turns_per_s 2 replicas / 1"] = _ratio(ours["turns_per_s"], mean["kvfence/1"]["turns_per_s"])
    for name, value in ratios.items():
        print(f"{name} (mean of {args.rounds} rounds): {value}")
    payload = {"plan": vars(plan), "args": vars(args), "runs": results, "means": mean, "ratios": ratios}
    write_json("ray_serve", payload)


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
