"""Does `kvfence audit --black-box` fail kvfence answering from someone else's KV? Each single-node fault,
isolation off and on, on the real model.

    .venv/bin/python bench/audit_faults.py [--rate 0.3] [--faults a,b] [--no-admin-key] [--threads 1]

Per fault and isolation setting: a fresh engine (SmolLM2, 64 pages, a 512-token window) serving in this
process with the fault armed at `--rate`, then the whole black-box audit against it, as `kvfence audit`
runs it (with the admin key, which only reads the batch-invariance pin and names changed answers' pages;
`--no-admin-key`: the pin from the model card, as any tenant sees it). Prints one row per run (exit status,
each probe's verdict, the replay's changed/compared answers and fence aborts, the fault's effects) and
writes bench/results/audit_faults.json. Issue 17 asks for a non-zero exit with isolation off and a pass
with it on; about 40 s per run on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from common import load_weights, write_json

from kvfence.audit.cli import add_arguments, run
from kvfence.config import EngineConfig
from kvfence.engine.engine import LLMEngine
from kvfence.harness.cluster import cluster
from kvfence.harness.tables import print_table
from kvfence.model.gguf import GGUFModel
from kvfence.model.llama import LlamaModel
from kvfence.model.tokenizer import Tokenizer

SINGLE_NODE = [
    "stale_mapping",
    "double_allocation",
    "stale_write",
    "cross_tenant_prefix_hit",
    "read_beyond_written",
]
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
ADMIN = "bench-admin"


def audit_once(gguf: GGUFModel, fault: str, rate: float, isolation: bool, admin: bool) -> dict[str, Any]:
    config = EngineConfig(num_pages=64, max_model_len=512, isolation=isolation, faults={fault: rate})
    engine = LLMEngine(config, LlamaModel.from_gguf(gguf), Tokenizer.from_gguf(gguf), log=lambda _: None)
    engine.model_file = gguf.path
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp, cluster(engine, api_keys=KEYS, admin_key=ADMIN) as running:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        report_file = Path(tmp, "report.json")
        argv = ["--url", running.url, "--black-box", "--json", str(report_file)]
        argv += [arg for key in KEYS for arg in ("--api-key", key)]
        argv += ["--admin-key", ADMIN] if admin else []
        status = run(parser.parse_args(argv))
        report = json.loads(report_file.read_text(encoding="utf-8"))
    replay = next(c for c in report["checks"] if c["name"] == "replay")["evidence"][0]
    return {
        "fault": fault,
        "rate": rate,
        "isolation": isolation,
        "exit": status,
        "checks": {c["name"]: c["status"] for c in report["checks"]},
        "replay": replay,
        "effects": len(engine.faults.effects),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=0.3, help="each fault's rate (default: %(default)s)")
    parser.add_argument("--faults", default=",".join(SINGLE_NODE), help="comma list (default: all five)")
    parser.add_argument("--no-admin-key", action="store_true", help="audit as a tenant only")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    args = parser.parse_args()
    gguf = load_weights(args.threads)
    runs = [
        audit_once(gguf, fault, args.rate, isolation, not args.no_admin_key)
        for fault in args.faults.split(",")
        for isolation in (False, True)
    ]
    print_table(
        [
            "fault",
            "isolation",
            "exit",
            "replay",
            "changed/compared",
            "fence aborts",
            "other probes",
            "effects",
        ],
        [
            [
                f"{r['fault']}:{r['rate']}",
                "on" if r["isolation"] else "off",
                r["exit"],
                r["checks"]["replay"],
                f"{r['replay']['changed']}/{r['replay']['compared']}",
                r["replay"]["integrity_aborts"],
                ", ".join(f"{k} {v}" for k, v in r["checks"].items() if k != "replay" and v != "PASS")
                or "all PASS",
                r["effects"],
            ]
            for r in runs
        ],
    )
    write_json("audit_faults", {"rate": args.rate, "admin_key": not args.no_admin_key, "runs": runs})


if __name__ == "__main__":
    main()
