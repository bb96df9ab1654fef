"""Soak: N minutes of mixed load on the real server over one in-process engine, watched every second.

    .venv/bin/python bench/soak.py [--minutes 10] [--clients 8] [--window 512] [--num-pages 128]
                                   [--cancel-rate 0.1] [--idle-every 60] [--threads 1] [--seed 0]

Clients of 4 tenants send the stress job mix of kvfence/harness/load.py (short, page-edge, at and beyond
the window, one-token prompts; some hung up mid-stream) without pause. Every second, on the engine thread
(AsyncEngine.call): `engine.check_integrity()` plus a count of live requests and free pages; and this
process's resident memory (VmRSS). Every --idle-every seconds the clients pause until the engine is idle,
and the free pages are read then: at idle every page must be free or cached and unreferenced. Reports
drift (RSS of the first minute vs the last, pages free at each idle point) in a table and
bench/results/soak.json. Loopback only; bounded by --minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
import torch
from common import load_weights, write_json

from kvfence.engine.async_engine import AsyncEngine
from kvfence.engine.engine import LLMEngine
from kvfence.harness.cluster import cluster
from kvfence.harness.load import KEEPALIVE_S, MODEL, Job, Outcome, Shape, make_jobs, make_tenants, run_job
from kvfence.harness.runs import ADMIN_KEY, serving_engine, tenant_keys
from kvfence.harness.tables import print_table
from kvfence.model.tokenizer import Tokenizer

SAMPLE_EVERY_S = 1.0
IDLE_TIMEOUT_S = 60.0


@dataclass
class Sample:
    t: float  # seconds since the load started
    rss_mib: float
    pages_free: int
    live_requests: int
    integrity: str  # "ok" or the assertion message


@dataclass
class IdlePoint:
    t: float
    pages_free: int
    num_pages: int
    rss_mib: float
    waited_s: float


@dataclass
class SoakResult:
    minutes: float
    samples: list[Sample] = field(default_factory=list)
    idle: list[IdlePoint] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)


def rss_mib() -> float:
    """This process's resident set size (VmRSS of /proc/self/status)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def engine_sample(engine: LLMEngine) -> tuple[int, int, str]:
    """On the engine thread: free pages, live requests, and the integrity check's verdict."""
    try:
        engine.check_integrity()
        verdict = "ok"
    except AssertionError as exc:
        verdict = f"FAILED: {exc}"
    live = len(engine.requests) + len(engine.scheduler.quarantined)
    return engine.allocator.num_free_pages, live, verdict


def endless_jobs(tokenizer: Tokenizer, shape: Shape, cancel_rate: float, seed: int) -> Iterator[Job]:
    """The stress job mix, batch after batch with fresh seeds (fresh prompts, same shapes)."""
    tenants = make_tenants(4, seed)
    for batch in itertools.count():
        yield from make_jobs(tokenizer, tenants, 64, shape, cancel_rate, seed * 10_000 + batch)


class Soak:
    def __init__(self, url: str, engine: AsyncEngine, jobs: Iterator[Job], args: argparse.Namespace) -> None:
        self.url, self.engine, self.jobs, self.args = url, engine, jobs, args
        self.result = SoakResult(args.minutes)
        self.running = asyncio.Event()  # cleared while an idle point is being taken
        self.started = time.monotonic()
        self.deadline = self.started + args.minutes * 60

    async def run(self) -> SoakResult:
        self.running.set()
        limits = httpx.Limits(max_connections=self.args.clients + 4, keepalive_expiry=KEEPALIVE_S)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(
                *(self.client_loop(client) for _ in range(self.args.clients)), self.watch(), self.pauses()
            )
        return self.result

    async def client_loop(self, client: httpx.AsyncClient) -> None:
        while True:
            await self.running.wait()
            if time.monotonic() >= self.deadline:
                return
            outcome: Outcome = await run_job(client, self.url, next(self.jobs), timeout_s=120)
            self.result.outcomes[outcome.kind] += 1

    async def watch(self) -> None:
        """One Sample per second until the deadline (a check waits for the engine's current step, so a
        long step delays the next sample; the cadence does not drift)."""
        for tick in itertools.count(1):
            if time.monotonic() >= self.deadline:
                return
            free, live, verdict = await asyncio.wrap_future(
                self.engine.call(lambda: engine_sample(self.engine.engine))
            )
            now = time.monotonic() - self.started
            self.result.samples.append(Sample(now, rss_mib(), free, live, verdict))
            await asyncio.sleep(max(0.0, self.started + tick * SAMPLE_EVERY_S - time.monotonic()))

    async def pauses(self) -> None:
        """Every --idle-every seconds (and at the end): stop the clients, wait for idle, read the pool."""
        while True:
            next_pause = min(self.deadline, time.monotonic() + self.args.idle_every)
            await asyncio.sleep(max(0.0, next_pause - time.monotonic()))
            self.running.clear()
            await self.idle_point()
            self.running.set()  # at the deadline this lets the clients see it and leave
            if time.monotonic() >= self.deadline:
                return

    async def idle_point(self) -> None:
        began = time.monotonic()
        while time.monotonic() - began < IDLE_TIMEOUT_S:
            free, live, _ = await asyncio.wrap_future(
                self.engine.call(lambda: engine_sample(self.engine.engine))
            )
            if live == 0:
                break
            await asyncio.sleep(0.1)
        num_pages = self.engine.engine.pool.num_pages
        now = time.monotonic() - self.started
        self.result.idle.append(IdlePoint(now, free, num_pages, rss_mib(), time.monotonic() - began))


def summarize(result: SoakResult) -> dict[str, Any]:
    samples, end = result.samples, result.samples[-1].t
    first = [s.rss_mib for s in samples if s.t < 60] or [samples[0].rss_mib]
    last = [s.rss_mib for s in samples if s.t >= end - 60] or [samples[-1].rss_mib]
    first_mib, last_mib = float(np.mean(first)), float(np.mean(last))
    return {
        "samples": len(samples),
        "integrity_failures": sum(s.integrity != "ok" for s in samples),
        "rss_first_minute_mib": first_mib,
        "rss_last_minute_mib": last_mib,
        "rss_drift_mib": last_mib - first_mib,
        "rss_drift_pct": 100 * (last_mib - first_mib) / first_mib,
        "rss_max_mib": max(s.rss_mib for s in samples),
        "idle_pages_free": [p.pages_free for p in result.idle],
        "idle_all_free": all(p.pages_free == p.num_pages for p in result.idle),
        "requests": dict(result.outcomes),
    }


def print_summary(result: SoakResult, summary: dict[str, Any]) -> None:
    print_table(
        ("t (s)", "pages free at idle", "of", "RSS MiB", "waited for idle (s)"),
        [[p.t, p.pages_free, p.num_pages, p.rss_mib, p.waited_s] for p in result.idle],
    )
    print()
    rows = [
        ["RSS first minute (MiB)", summary["rss_first_minute_mib"]],
        ["RSS last minute (MiB)", summary["rss_last_minute_mib"]],
        ["RSS drift (MiB)", summary["rss_drift_mib"]],
        ["RSS drift (%)", summary["rss_drift_pct"]],
        ["integrity checks run / failed", f"{summary['samples']} / {summary['integrity_failures']}"],
        ["every page free at every idle point", summary["idle_all_free"]],
        ["requests by outcome", summary["requests"]],
    ]
    print_table(("measure", "value"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--cancel-rate", type=float, default=0.1)
    parser.add_argument("--idle-every", type=float, default=60.0, help="seconds between idle points")
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (the server shares this process)"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf = load_weights()
    engine = serving_engine(gguf, args.window, args.num_pages, faults={})
    keys = tenant_keys(make_tenants(4, args.seed))
    jobs = endless_jobs(
        Tokenizer.from_gguf(gguf), Shape(args.window, 16, args.max_tokens), args.cancel_rate, args.seed
    )
    with cluster(engine, api_keys=keys, admin_key=ADMIN_KEY, model_name=MODEL) as running:
        result = asyncio.run(Soak(running.url, running.engine, jobs, args).run())
    summary = summarize(result)
    print_summary(result, summary)
    samples = [asdict(s) for s in result.samples]
    idle = [asdict(p) for p in result.idle]
    write_json("soak", {"args": vars(args), "summary": summary, "idle": idle, "samples": samples})
    failed = summary["integrity_failures"] or not summary["idle_all_free"]
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
