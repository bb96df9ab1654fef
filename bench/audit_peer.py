"""`kvfence audit --black-box` against a peer engine: llama.cpp's llama-server on the same GGUF.

    .venv/bin/python bench/audit_peer.py [--llama-server PATH | --build] [--model FILE|smollm2|gemma3-270m]
                                         [--runs 3] [--threads 2] [--slots 16] [--context 8192]
    .venv/bin/python bench/audit_peer.py --url http://127.0.0.1:8911 --peer vllm   # any running server

llama-server (built from the llama-cpp-python 0.3.36 sdist by ../shared/peers/build-llama-server.sh, or
the binary given) serves the model with two API keys, continuous batching over `--slots` slots; the whole
black-box audit runs against it `--runs` times, as an operator would run it. llama-server declares no batch
invariance, so the replay check is decided by the near-tie oracle from the logprobs it answers. Prints one
row per run (exit status, every check's verdict, the replay's oracle, margin and departures) and writes
bench/results/audit_peer.json.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from common import add_llama_server_options, write_json

from kvfence.audit.black_box import audit_black_box
from kvfence.cli_options import model_file
from kvfence.harness.peers import llama_server, llama_server_binary
from kvfence.harness.tables import print_table
from kvfence.pins import default_model_path

KEYS = ("peer-key-a", "peer-key-b")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_llama_server_options(parser)
    parser.add_argument("--model", type=model_file, help="GGUF file or packaged name (default: smollm2)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--url", help="audit this running server instead of starting llama-server")
    parser.add_argument("--peer", default="llama-server", help="its name in the results (with --url)")
    args = parser.parse_args()
    if args.url:
        runs = audit_runs(args.url, args.runs)
        return finish(args.peer, runs, {"url": args.url})
    binary = llama_server_binary(args.llama_server, build=args.build)
    model = args.model or default_model_path()
    with llama_server(binary, model, args.threads, args.slots, args.context, KEYS) as peer:
        runs = audit_runs(peer.url, args.runs)
    return finish("llama-server", runs, {"binary": str(binary), "model": model.name})


def audit_runs(url: str, count: int) -> list[dict[str, Any]]:
    runs = []
    for index in range(count):
        runs.append(audit_black_box(url, KEYS))
        print(f"run {index + 1}: exit {runs[-1]['exit']}: {runs[-1]['replay_details']}", flush=True)
    return runs


def finish(peer: str, runs: list[dict[str, Any]], about: dict[str, str]) -> int:
    """The table, the JSON (bench/results/audit_peer[_NAME].json), and 0 when every replay passed."""
    print_table(
        [
            "run",
            "exit",
            "replay",
            "oracle",
            "margin",
            "changed/compared",
            "beyond",
            "explained",
            "other checks",
        ],
        [
            [
                i + 1,
                r["exit"],
                r["checks"]["replay"],
                r["replay"].get("oracle"),
                r["replay"].get("margin_nats", "-"),
                f"{r['replay']['changed']}/{r['replay']['compared']}",
                r["replay"].get("beyond", "-"),
                r["replay"].get("explained", "-"),
                ", ".join(f"{k} {v}" for k, v in r["checks"].items() if k != "replay"),
            ]
            for i, r in enumerate(runs)
        ],
    )
    name = "audit_peer" if peer == "llama-server" else f"audit_peer_{peer}"
    write_json(name, {"peer": peer, **about, "runs": runs})
    return 0 if all(r["checks"]["replay"] == "PASS" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
