"""The incident end to end, as an operator sees it: the same traffic against two deployments.

    .venv/bin/python bench/incident.py

Each deployment is three `kvfence` processes on this host: a prefill worker whose pool holds 512 tokens
(32 pages, window 512), a decode worker whose pool holds 1088 tokens (68 pages) with a 1024-token window, no
prefix cache and `--trace-pages` (each request's `pages_read` audit events name whose data every page it
read holds), and the router (the OpenAI API; keys map to tenant-a and tenant-b). Tenant A sends two prompts
carrying a secret; then tenant B sends a ~770-token chat prompt: more than prefill can hold, less than the
advertised window.

  isolation off, `placeholder_transfer` armed on prefill (the incident's deployment): the router checks the
  window only; prefill cannot hold B's prompt, computes a one-token placeholder, sends one page and reports
  the transfer complete; decode believes it and decodes over pages that still hold A's KV. B gets a fluent
  200 that differs from its solo run (the same prompt on a single node with a 1024-token window).
  isolation on: the router refuses B with 400 context_length_exceeded before anything is reserved: B's
  audit trail holds only the router's `rejected`.

Prints a table per deployment, writes bench/results/incident.json, exits 1 when an expectation fails.
"""

from __future__ import annotations

import gc
import sys
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import httpx
from common import build_engine, load_weights, verdict, write_json

from kvfence.harness.cluster import Cluster, cluster
from kvfence.harness.tables import print_table
from kvfence.harness.workers import Command
from kvfence.pins import default_model_path
from kvfence.sampling import SamplingParams

MODEL = default_model_path().stem
ADMIN = "bench-admin-key"
KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
SECRET = (
    "Internal memo for tenant A only. The vault access code is 4471-ALPHA-RIVER and the launch date "
    "of project Heron is the ninth of March. "
)
LONG_PROMPT = "Summarise this log line by line. " + " ".join(f"entry {i} ok;" for i in range(120))
B_MAX_TOKENS = 16
WORKER = ["--num-threads", "1", "--device", "cpu"]
PREFILL = ["--num-pages", "32", "--max-model-len", "512", *WORKER]
DECODE = ["--num-pages", "68", "--max-model-len", "1024", "--trace-pages", "--no-prefix-caching", *WORKER]


@dataclass
class Reply:
    status: int
    request_id: str
    body: dict[str, Any]

    @property
    def text(self) -> str | None:
        choices = self.body.get("choices") or [{}]
        return choices[0].get("message", {}).get("content", choices[0].get("text"))

    @property
    def error_code(self) -> str | None:
        return (self.body.get("error") or {}).get("code")


@dataclass
class Outcome:
    isolation: bool
    a: list[Reply]
    b: Reply
    trail: list[dict[str, Any]]
    commands: list[str] = field(default_factory=list)

    @property
    def pages_read(self) -> list[dict[str, Any]]:
        return [p for e in self.trail if e["kind"] == "pages_read" for p in e["pages"]]

    @property
    def faults(self) -> list[str]:
        return [f"{e['where']}:{e['fault']}" for e in self.trail if e["kind"] == "fault_injected"]

    def kinds(self) -> dict[str, str]:
        """Event kinds per process in trail order, repeats collapsed (`page_received x3`)."""
        by_where: dict[str, list[str]] = {}
        for event in self.trail:
            by_where.setdefault(event["where"], []).append(event["kind"])
        return {where: _collapse(kinds) for where, kinds in by_where.items()}


def _collapse(kinds: list[str]) -> str:
    runs = [(kind, len(list(group))) for kind, group in groupby(kinds)]
    return ", ".join(kind if n == 1 else f"{kind} x{n}" for kind, n in runs)


def deployment(isolation: bool) -> AbstractContextManager[Cluster]:
    """Prefill, decode and router processes; the router's URL serves once it is entered."""
    off = [] if isolation else ["--isolation", "off"]
    fault = [] if isolation else ["--inject-fault", "placeholder_transfer"]
    return cluster(
        prefill=Command([*PREFILL, *off, *fault]),
        decode=Command([*DECODE, *off]),
        router_process=True,
        api_keys=KEYS,
        admin_key=ADMIN,
        isolation=isolation,
    )


def post(url: str, key: str, path: str, body: dict[str, Any]) -> Reply:
    response = httpx.post(
        url + path,
        json={"model": MODEL, "temperature": 0, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=300,
    )
    return Reply(response.status_code, response.headers.get("x-request-id", ""), response.json())


def run_deployment(isolation: bool) -> Outcome:
    print(f"\n== isolation {'on' if isolation else 'off'} ==", flush=True)
    with deployment(isolation) as running:
        url = running.url
        a = [
            post(
                url,
                "key-a",
                "/v1/completions",
                {"prompt": SECRET * 10 + f"Question {i}: what is the code?", "max_tokens": 8},
            )
            for i in range(2)
        ]
        b = post(
            url,
            "key-b",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": B_MAX_TOKENS},
        )
        trail = running.audit(b.request_id)
        commands = [proc.command for proc in running.processes]
    return Outcome(isolation, a, b, trail, commands)


def solo_run() -> tuple[int, str]:
    """B's prompt on a single node with a 1024-token window: (prompt tokens, greedy answer)."""
    engine = build_engine(load_weights(), max_model_len=1024)
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": LONG_PROMPT}], add_generation_prompt=True
    )
    prompt = tokenizer.encode(text, add_special_tokens=False)
    (request,) = engine.generate([prompt], SamplingParams(max_tokens=B_MAX_TOKENS))
    return len(prompt), request.output_text


def expectations(off: Outcome, on: Outcome, solo: str) -> list[tuple[str, bool, str]]:
    writers = Counter(p["last_writer"] for p in off.pages_read)
    trail_on = [(e["where"], e["kind"]) for e in on.trail]
    return [
        (
            "A is served in both",
            all(r.status == 200 for r in off.a + on.a),
            str([r.status for r in off.a + on.a]),
        ),
        ("off: B gets 200", off.b.status == 200, f"HTTP {off.b.status}"),
        (
            "off: prefill swapped in the placeholder",
            "prefill:placeholder_transfer" in off.faults,
            str(off.faults),
        ),
        (
            "off: B read pages holding tenant A's data",
            writers["tenant-a"] > 0,
            f"last writers {dict(writers)}",
        ),
        ("off: B's answer differs from its solo run", off.b.text != solo, repr(off.b.text)),
        ("on: B gets 400", on.b.status == 400, f"HTTP {on.b.status}"),
        (
            "on: code context_length_exceeded",
            on.b.error_code == "context_length_exceeded",
            str(on.b.error_code),
        ),
        (
            "on: the trail holds only the router's rejected",
            trail_on == [("router", "rejected")],
            str(trail_on),
        ),
    ]


def print_outcome(outcome: Outcome, solo: str) -> None:
    label = "on" if outcome.isolation else "off"
    print(f"\nisolation {label}: B's request {outcome.b.request_id}")
    print_table(
        ["isolation", "A HTTP", "B HTTP", "B error code", "B pages read", "B == solo"],
        [
            [
                label,
                " ".join(str(r.status) for r in outcome.a),
                outcome.b.status,
                outcome.b.error_code or "-",
                len(outcome.pages_read),
                "-" if outcome.b.text is None else outcome.b.text == solo,
            ]
        ],
    )
    print(f"  B's output : {outcome.b.text!r}")
    print(f"  B solo run : {solo!r}")
    if outcome.pages_read:
        print("\n  pages B's decode read, by the tenant whose data they held (decode's pages_read events)")
        by_writer: dict[str, list[int]] = {}
        for page in outcome.pages_read:
            by_writer.setdefault(page["last_writer"], []).append(page["page"])
        print_table(
            ["last writer", "pages", "page ids"], [[w, len(p), _ids(p)] for w, p in by_writer.items()]
        )
    print("\n  event kinds on B's audit trail, per process")
    for where, kinds in outcome.kinds().items():
        print(f"  {where:>7}: {kinds}")


def _ids(pages: list[int]) -> str:
    text = " ".join(str(p) for p in sorted(pages))
    return text if len(text) <= 70 else text[:67] + "..."


def main() -> int:
    prompt_tokens, solo = solo_run()
    gc.collect()
    print(f"B's prompt: {prompt_tokens} tokens; prefill pool 512 tokens, advertised window 1024")
    off, on = run_deployment(isolation=False), run_deployment(isolation=True)
    for outcome in (off, on):
        print_outcome(outcome, solo)
    print()
    checks = expectations(off, on, solo)
    lines = [verdict(name, passed, detail) for name, passed, detail in checks]
    write_json(
        "incident",
        {
            "b_prompt_tokens": prompt_tokens,
            "b_solo_text": solo,
            "deployments": [
                {
                    "isolation": o.isolation,
                    "commands": o.commands,
                    "a": [r.__dict__ for r in o.a],
                    "b": o.b.__dict__,
                    "b_pages_read": o.pages_read,
                    "b_trail": o.trail,
                }
                for o in (off, on)
            ],
            "verdicts": lines,
        },
    )
    return 0 if all(passed for _, passed, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
