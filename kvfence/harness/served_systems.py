"""One `kvfence serve` system (single node or disaggregated) as processes, loaded through the HTTP API and
timed beside the CPU each of its processes used: what bench/disagg.py compares systems with.

Contracts: `run_system` waits for a quiet machine (bounded), streams warm-up prompts, then the measured ones
(`timed_runs.run_streams`: greedy, ignore_eos, a broken answer raises); its foreign CPU share leaves out
the server's own processes; a disaggregated system's trails are read with the admin key after the load.
Processes are named from /proc: the server, its worker processes in start order (`worker_list`'s names),
multiprocessing's tracker; any other by its pid. `scale_ratios` compares the runs of three systems at each
concurrency (a run of each must be there).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from kvfence.disagg.keys import worker_names
from kvfence.harness.cluster import cluster
from kvfence.harness.contention import ForeignCpu, wait_for_quiet
from kvfence.harness.procs import Proc, descendants, live_command, process_cpu_seconds
from kvfence.harness.timed_runs import run_streams
from kvfence.harness.timings import RunResult

ADMIN = "bench-admin-key"  # the systems' admin key: the trails are read with it
LOG_TRANSPORT = {"CURVE": "CURVE with ephemeral keys", "plain": "INSECURE"}  # in serve's "transport:" line


@dataclass
class SystemRun:
    """One system's measured load: its result, its request ids, each process's CPU (% of one core) at idle
    and during the load, its trails (disaggregated only) and the transport its log named."""

    result: RunResult
    request_ids: list[str]
    idle_cpu_pct: dict[str, float]
    trails: list[list[dict[str, Any]]]
    transport: str = "-"  # CURVE or plain for a disaggregated system
    round: int = 0
    load_cpu_pct: dict[str, float] | None = None  # each process, % of one core, during the load

    def summary(self) -> dict[str, Any]:
        extra = {"transport": self.transport, "round": self.round, "idle_cpu_pct": self.idle_cpu_pct}
        extra["load_cpu_pct"] = self.load_cpu_pct
        return {**self.result.summary(), **extra}


def server_transport(server: Proc) -> str:
    """The transport `kvfence serve --disaggregated` says it runs (its "transport: ..." log line)."""
    lines = [line.strip() for line in server.log if line.startswith("transport:")]
    for transport, text in LOG_TRANSPORT.items():
        if lines and text in lines[-1]:
            return transport
    raise RuntimeError(f"no recognisable transport line in the server's log: {lines}")


def run_system(
    label: str,
    serve_args: list[str],
    prompts: list[list[int]],
    warm: list[list[int]],
    max_tokens: int,
    concurrency: int,
    round_: int = 0,
    admin_key: str = ADMIN,
    transport_expected: str | None = None,
) -> SystemRun:
    """`kvfence serve SERVE_ARGS` as processes (after a wait for a quiet machine): `warm` streamed, then
    `prompts` at `concurrency`, timed, with each process's CPU during the load and at idle, and (for a
    disaggregated system) every measured request's audit trail. `transport_expected` (CURVE or plain): the
    server's own log must say it runs that transport."""
    wait_for_quiet(max_wait_s=30)
    with cluster(serve_args=serve_args, admin_key=admin_key) as running:
        url, server = running.url, running.processes[0]
        transport = "-"
        if transport_expected is not None:
            transport = server_transport(server)
            assert transport == transport_expected, f"{label} runs {transport}, not {transport_expected}"
        run_streams(url, warm, 8, 2)
        tree = [server.pid, *descendants(server.pid)]
        before, foreign = {p: process_cpu_seconds(p) for p in tree}, ForeignCpu()
        ids, timings, wall = run_streams(url, prompts, max_tokens, concurrency)
        used = {p: process_cpu_seconds(p) - before[p] for p in tree}
        own_share = sum(used.values()) / (wall * (os.cpu_count() or 1))
        names = process_names(server, tree, worker_list(serve_args))
        load_cpu = {names.get(p, f"pid {p}"): used[p] / wall * 100 for p in tree}
        result = RunResult(
            label,
            concurrency,
            len(timings),
            wall,
            sum(t.num_output for t in timings),
            timings,
            foreign_cpu=max(0.0, foreign.share() - own_share),
        )
        idle = idle_cpu(names, tree)
        trails = [running.audit(i) for i in ids] if "--disaggregated" in serve_args else []
        return SystemRun(result, ids, idle, trails, transport, round_, load_cpu)


def worker_list(serve_args: list[str]) -> list[str]:
    """The worker names `serve --disaggregated` with these arguments starts, in start order."""
    counts = {role: 1 for role in ("prefill", "decode")}
    for role in counts:
        flag = f"--{role}-workers"
        if flag in serve_args:
            counts[role] = int(serve_args[serve_args.index(flag) + 1])
    return [name for role, n in counts.items() for name in worker_names(role, n)]


def process_names(server: Proc, tree: list[int], workers: list[str]) -> dict[int, str]:
    """The server's processes by name. Worker processes (multiprocessing `spawn_main` children) are
    named in start order (pids rise), as `worker_list` names them."""
    names = {server.pid: "server"}
    spawned = sorted(pid for pid in tree if "spawn_main" in (live_command(pid) or ""))
    names |= dict(zip(spawned, workers, strict=False))
    return names | {pid: "mp tracker" for pid in tree if "resource_tracker" in (live_command(pid) or "")}


def idle_cpu(names: dict[int, str], tree: list[int], seconds: float = 3.0) -> dict[str, float]:
    """% of one core each process of the server used while nothing was in flight."""
    time.sleep(1.0)
    before = {pid: process_cpu_seconds(pid) for pid in tree}
    time.sleep(seconds)
    return {
        names.get(pid, f"pid {pid}"): (process_cpu_seconds(pid) - before[pid]) / seconds * 100 for pid in tree
    }


def scale_ratios(
    runs: list[SystemRun], concurrencies: list[int], labels: tuple[str, str, str]
) -> dict[int, Any]:
    """At each concurrency, of the systems `labels` (single node, 1x1 workers, 2x2 workers): 2x2 / 1x1
    output tok/s and TTFT p50, and 1x1 / single node output tok/s."""
    ratios = {}
    for concurrency in concurrencies:
        single, one, two = (
            next(x.result for x in runs if (x.result.label, x.result.concurrency) == (label, concurrency))
            for label in labels
        )
        ratios[concurrency] = {
            "tok_per_s_2x2_over_1x1": two.tok_per_s / one.tok_per_s,
            "ttft_p50_2x2_over_1x1": two.pct("ttft", 50) / one.pct("ttft", 50),
            "tok_per_s_1x1_over_single": one.tok_per_s / single.tok_per_s,
        }
    return ratios
