"""Speculative decoding (prompt lookup, or a draft model) against the same server without it, side by side
in one run.

    .venv/bin/python bench/speculative.py [--models smollm2,gemma3-270m] [--streams 1,16] [--requests 3]
                                          [--max-tokens 128] [--threads 2] [--spec K,MIN,MAX]
                                          [--draft-model MODEL]

`--spec` defaults to 5,2,4: vLLM's documented prompt-lookup example (5 speculative tokens, n-grams of up
to 4), matching n-grams from 2 tokens. `--models` takes packaged names or paths (a GGUF, a Hugging Face
directory); with `--draft-model` the speculating server drafts K tokens with that model (vLLM's
draft_model) instead of prompt lookup (its results keep the key "ngram": the speculating server).

Two `kvfence serve` processes on the same model, defaults otherwise: one with
`--speculative-config '{"method": "ngram", ...}'`, one without; the rows alternate between them. Workloads:
`copy` (kvfence.harness.copy_tasks: a code file with one name changed, a JSON document with one field
changed, a quoted passage, in turn; fresh names each request) and `fresh` (random-token prompts of 246 tokens:
nothing to copy). Greedy, `ignore_eos`, `--max-tokens` each; a row runs plain, ngram, ngram, plain (fresh
prompts each), so a machine drifting at a steady pace cancels. Prints output tok/s of both, the ratio, and
the speculating server's acceptance per draft position over the row (from /metrics) and the row's spread
(the larger gap between one server's two runs of the row, over their mean: the machine's noise); writes
bench/results/speculative.json. Exit status 1 when a verdict fails (issue 63's): copy at one stream >= 2x,
copy at the largest stream count >= 1.3x, fresh at every stream count >= 0.97x. Each request's draft length
adapts to its acceptance past the step's 16-row floor (engine/draft_lengths.py, scheduler.py).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

import httpx
from common import exit_status, make_prompts, run_streams, verdict, write_json

from kvfence.cli_checks import model_file
from kvfence.harness.cluster import cluster
from kvfence.harness.copy_tasks import copy_prompts
from kvfence.harness.tables import print_table
from kvfence.model.gguf import read_header
from kvfence.model.tokenizer import Tokenizer

WINDOW = 2048
PROMPT_LEN = 246  # the fresh workload's, as bench/vs_llama.py's


SERIES = re.compile(r"^(kvfence_spec_decode_\w+_total)(?:\{([^}]*)\})? (\S+)$", re.M)
POSITION = re.compile(r'position="(\d+)"')


def acceptance(url: str) -> dict[str, float]:
    """The speculating server's spec-decode counters now, summed over roles ("name@position" by position)."""
    found: dict[str, float] = {}
    for name, labels, value in SERIES.findall(httpx.get(f"{url}/metrics", timeout=30).text):
        position = POSITION.search(labels)
        key = f"{name}@{position.group(1)}" if position else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


def rates(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts = delta.get("kvfence_spec_decode_num_drafts_total", 0.0)
    positions = sorted((k for k in delta if "@" in k), key=lambda k: int(k.split("@")[1]))
    return {
        "drafts": drafts,
        "acceptance": delta.get("kvfence_spec_decode_num_accepted_tokens_total", 0.0)
        / max(delta.get("kvfence_spec_decode_num_draft_tokens_total", 0.0), 1.0),
        "per_position": [delta[k] / max(drafts, 1.0) for k in positions],
    }


def bench_model(name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    path = model_file(name)
    tokenizer = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer(read_header(path)[1])
    k, low, high = args.spec
    spec: dict[str, Any] = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }
    if args.draft_model is not None:
        spec = {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": k}
    base = ["--model", str(path), "--num-threads", str(args.threads), "--max-model-len", str(WINDOW)]
    rows = []
    with (
        cluster(serve_args=base) as plain,
        cluster(serve_args=[*base, "--speculative-config", json.dumps(spec)]) as ngram,
    ):
        servers = {"plain": plain.url, "ngram": ngram.url}
        for url in servers.values():  # a warm-up each
            run_streams(url, copy_prompts(tokenizer, 2, seed=-1), 16, 2, path.stem)
        salt = 0
        for workload in ("copy", "fresh"):
            for streams in args.streams:
                found: dict[str, Any] = {"model": path.name, "workload": workload, "streams": streams}
                tokens, seconds = {"plain": 0, "ngram": 0}, {"plain": 0.0, "ngram": 0.0}
                runs: dict[str, list[float]] = {"plain": [], "ngram": []}
                before = acceptance(servers["ngram"])
                for system in ("plain", "ngram", "ngram", "plain"):  # A-B-B-A: a steady drift cancels
                    salt += 1
                    count = args.requests * streams
                    prompts = (
                        copy_prompts(tokenizer, count, seed=salt)
                        if workload == "copy"
                        else make_prompts(tokenizer, count, PROMPT_LEN, salt=salt)
                    )
                    _, timings, wall = run_streams(
                        servers[system], prompts, args.max_tokens, streams, path.stem
                    )
                    tokens[system] += sum(t.num_output for t in timings)
                    seconds[system] += wall
                    runs[system].append(sum(t.num_output for t in timings) / wall)
                found.update({system: tokens[system] / seconds[system] for system in servers})
                found["spec"] = rates(before, acceptance(servers["ngram"]))
                found["ratio"] = found["ngram"] / found["plain"]
                found["spread"] = max(abs(a - b) / ((a + b) / 2) for a, b in runs.values())
                print(f"{name} {workload} x{streams}: {found['ratio']:.2f}x", flush=True)
                rows.append(found)
    return rows


def verdicts(rows: list[dict[str, Any]], streams: list[int]) -> list[str]:
    targets = {("copy", max(streams)): 1.3, ("copy", 1): 2.0} | {("fresh", n): 0.97 for n in streams}
    found = []
    for r in rows:
        target = targets.get((r["workload"], r["streams"]))
        if target is None:
            continue
        name = f"{r['model']} {r['workload']} x{r['streams']}: ngram / plain tok/s"
        detail = f"{r['ratio']:.2f}x (target >= {target}x; spread {r['spread']:.1%})"
        found.append(verdict(name, r["ratio"] >= target, detail))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="smollm2,gemma3-270m")
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument(
        "--requests",
        type=int,
        default=3,
        help="requests per stream in each run (default 3: a one-stream run holds each copy task once)",
    )
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--spec", type=lambda s: [int(x) for x in s.split(",")], default=[5, 2, 4])
    parser.add_argument(
        "--draft-model",
        metavar="MODEL",
        help="speculate with this draft model (vLLM's draft_model: K of --spec) instead of prompt lookup",
    )
    args = parser.parse_args()
    rows = [r for name in args.models.split(",") for r in bench_model(name, args)]
    print_table(
        [
            "model", "workload", "streams", "plain tok/s", "spec tok/s", "ratio", "spread", "accepted",
            "per position",
        ],
        [
            [
                r["model"], r["workload"], r["streams"], f"{r['plain']:.1f}", f"{r['ngram']:.1f}",
                f"{r['ratio']:.2f}x", f"{r['spread']:.1%}", f"{r['spec']['acceptance']:.0%}",
                " ".join(f"{p:.2f}" for p in r["spec"]["per_position"]),
            ]
            for r in rows
        ],
    )  # fmt: skip
    write_json("speculative", {"spec": args.spec, "rows": rows, "verdicts": verdicts(rows, args.streams)})
    return exit_status()


if __name__ == "__main__":
    sys.exit(main())
