"""One `kvfence audit --black-box` run as a tenant of a running server, for the benches and tests that
audit peer engines (bench/audit_peer.py, tests/vllm): the keys written to files only their owner may read
(`audit_key_args`), the report read back from its JSON.

Contract: `audit_black_box(url, keys)` returns the exit status (cli.run's), each check's status by name,
the replay's summary (its first evidence item) and its details line; the key files and the report are gone
when it returns.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvfence.audit.cli import run
from kvfence.audit.options import add_arguments
from kvfence.harness.key_files import audit_key_args


def audit_black_box(url: str, keys: Sequence[str]) -> dict[str, Any]:
    """One black-box audit of `url` with one tenant per key: its exit status and verdicts."""
    with tempfile.TemporaryDirectory() as tmp:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        out = Path(tmp, "report.json")
        argv = ["--url", url, "--black-box", "--json", str(out), *audit_key_args(Path(tmp), keys)]
        status = run(parser.parse_args(argv))
        report = json.loads(out.read_text(encoding="utf-8"))
    checks = {c["name"]: c for c in report["checks"]}
    return {
        "exit": status,
        "checks": {name: c["status"] for name, c in checks.items()},
        "replay": checks["replay"]["evidence"][0],
        "replay_details": checks["replay"]["details"],
    }
