"""Disaggregated serving vs single node on W1, through the HTTP API, plus what page checksums cost.

    .venv/bin/python bench/disagg.py [--requests N] [--concurrency C] [--max-tokens N] [--pages N]

Same cores for both systems (this machine has 2):
  single node     `kvfence serve --num-threads 2`: one engine, 2 torch threads;
  disaggregated   `kvfence serve --disaggregated --num-threads 1`: a prefill and a decode worker process with
                  1 torch thread each, the router and the HTTP server in the parent process.
Each server is a subprocess; this process only drives load: W1 (32 distinct 64-token prompts, 128 output
tokens, greedy, ignore_eos so every request yields exactly 128 tokens) on /v1/completions with token-id
prompts and `stream: true`, 16 requests in flight (httpx.AsyncClient).
  TTFT  request sent -> first SSE chunk carrying text;
  TPOT  (last chunk - first text chunk) / (completion_tokens - 1), completion_tokens from the usage chunk.
Transfer GB/s comes from the audit trail of every measured request (admin endpoint): bytes = decode's
`page_received` events x bytes per page; "send" time = prefill's transfer_started -> transfer_complete (read,
checksum and hand each page to ZeroMQ); "end to end" time = transfer_started -> decode's last page_received
(adds the wire, decode's checks and write, and the wait for decode's current step to end).
"decode burst" = pages 2..n / first -> last page_received: decode's own rate once it handles the pages.
Checksum cost: there is no switch to turn verification off, so a microbenchmark replays the handoff of
`--pages` real-size pages in this process, one torch thread (prefill's read+serialize and xxh3_64, a ZeroMQ
send over loopback TCP, decode's receive, xxh3_64 verification and write, each timed, one page at a time)
and reports the checksums' share of that time.
"idle CPU" is what each server process burned, in % of one core, during 3 s with no request in flight.
Writes bench/results/disagg.json.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch
import xxhash
from common import (
    RUN_HEADERS,
    W1,
    ForeignCpu,
    RequestTiming,
    RunResult,
    make_prompts,
    run_cells,
    wait_for_quiet,
    write_json,
)

from kvfence.cache.pool import KVPool
from kvfence.config import EngineConfig
from kvfence.disagg.connector import Message, ZmqConnector
from kvfence.harness.cluster import cluster
from kvfence.harness.procs import Proc, descendants
from kvfence.harness.sse import aiter_events
from kvfence.harness.tables import print_table
from kvfence.model.gguf import LlamaConfig, read_header
from kvfence.model.tokenizer import Tokenizer
from kvfence.pins import default_model_path

MODEL = default_model_path().stem
ADMIN = "bench-admin-key"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = {  # label -> extra `kvfence serve` arguments
    "single node": ["--num-threads", "2"],
    "disaggregated": ["--disaggregated", "--num-threads", "1"],
}


# ---- the server's processes ------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ---- load through the HTTP API --------------------------------------------------------------------------


async def stream_one(
    client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int
) -> tuple[str, RequestTiming]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        request_id = response.headers["x-request-id"]
        async for chunk in aiter_events(response.aiter_lines()):
            if "error" in chunk:
                raise RuntimeError(f"{request_id} aborted: {chunk['error']}")
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            if any(choice["text"] for choice in chunk["choices"]) and first is None:
                first = time.monotonic()
            if chunk["choices"]:
                last = time.monotonic()
    assert first is not None and last is not None and tokens == max_tokens, (request_id, tokens)
    timing = RequestTiming(first - started, (last - first) / (tokens - 1), last - started, tokens)
    return request_id, timing


async def drive(
    url: str, prompts: list[list[int]], max_tokens: int, concurrency: int
) -> tuple[list[str], list[RequestTiming], float]:
    """Every prompt, at most `concurrency` in flight; returns request ids, timings and the wall time."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:

        async def one(prompt: list[int]) -> tuple[str, RequestTiming]:
            async with gate:
                return await stream_one(client, url, prompt, max_tokens)

        started = time.monotonic()
        done = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.monotonic() - started
    return [d[0] for d in done], [d[1] for d in done], wall


@dataclass
class SystemRun:
    result: RunResult
    request_ids: list[str]
    idle_cpu_pct: dict[str, float]
    trails: list[list[dict[str, Any]]]


def run_system(
    label: str, prompts: list[list[int]], warm: list[list[int]], max_tokens: int, concurrency: int
) -> SystemRun:
    wait_for_quiet(max_wait_s=30)
    with cluster(serve_args=SYSTEMS[label], admin_key=ADMIN) as running:
        url, server = running.url, running.processes[0]
        asyncio.run(drive(url, warm, 8, 2))
        tree = [server.pid, *descendants(server.pid)]
        cpu_before, foreign = sum(cpu_seconds(p) for p in tree), ForeignCpu()
        ids, timings, wall = asyncio.run(drive(url, prompts, max_tokens, concurrency))
        own_share = (sum(cpu_seconds(p) for p in tree) - cpu_before) / (wall * (os.cpu_count() or 1))
        result = RunResult(
            label,
            concurrency,
            len(timings),
            wall,
            sum(t.num_output for t in timings),
            timings,
            foreign_cpu=max(0.0, foreign.share() - own_share),
        )
        idle = idle_cpu(server, tree)
        trails = [running.audit(i) for i in ids] if "--disaggregated" in SYSTEMS[label] else []
        return SystemRun(result, ids, idle, trails)


def idle_cpu(server: Proc, tree: list[int], seconds: float = 3.0) -> dict[str, float]:
    """% of one core each process of the server used while nothing was in flight. The worker processes
    (multiprocessing `spawn_main` children) are named in start order: prefill, then decode."""
    time.sleep(1.0)
    before = {pid: cpu_seconds(pid) for pid in tree}
    time.sleep(seconds)
    names = {server.pid: "server"}
    workers = sorted(pid for pid in tree if b"spawn_main" in _cmdline(pid))
    names |= dict(zip(workers, ("prefill", "decode"), strict=False))
    names |= {pid: "mp tracker" for pid in tree if b"resource_tracker" in _cmdline(pid)}
    return {names.get(pid, f"pid {pid}"): (cpu_seconds(pid) - before[pid]) / seconds * 100 for pid in tree}


# ---- transfer rate from the audit trail -----------------------------------------------------------------


def page_bytes(config: LlamaConfig) -> int:
    return KVPool.bytes_per_page(
        config.num_layers, EngineConfig().page_size, config.num_kv_heads, config.head_dim, torch.float32
    )


def transfer_rates(trails: list[list[dict[str, Any]]], bytes_per_page: int) -> dict[str, float]:
    pages = burst_pages = 0
    send_s = e2e_s = burst_s = 0.0
    per_request = []
    for events in trails:
        ts = {(e["where"], e["kind"]): e["ts"] for e in events if e["kind"] != "page_received"}
        received = [e["ts"] for e in events if (e["where"], e["kind"]) == ("decode", "page_received")]
        started = ts[("prefill", "transfer_started")]
        pages += len(received)
        send_s += ts[("prefill", "transfer_complete")] - started
        e2e_s += max(received) - started
        burst_pages += len(received) - 1
        burst_s += max(received) - min(received)
        per_request.append(len(received) * bytes_per_page / (max(received) - started) / 1e9)
    moved = pages * bytes_per_page
    return {
        "requests": len(trails),
        "pages": pages,
        "bytes_per_page": bytes_per_page,
        "mb_moved": moved / 1e6,
        "send_s": send_s,
        "end_to_end_s": e2e_s,
        "send_gb_per_s": moved / send_s / 1e9,
        "end_to_end_gb_per_s": moved / e2e_s / 1e9,
        "end_to_end_gb_per_s_median_request": float(np.median(per_request)),
        "decode_burst_gb_per_s": burst_pages * bytes_per_page / burst_s / 1e9 if burst_s else float("nan"),
    }


# ---- checksum microbenchmark ----------------------------------------------------------------------------

STAGES = ("serialize", "checksum", "send", "receive", "verify", "write")


def checksum_microbench(config: LlamaConfig, num_pages: int, pool_pages: int = 64) -> dict[str, Any]:
    """The handoff of `num_pages` pages, one after another, in this process: the same calls as
    PrefillWorker._send_pages and DecodeWorker.on_page/_write, each stage timed. One torch thread, as the
    disaggregated workers here run (with 2 threads on a busy machine the page copies alone take ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _microbench(config, num_pages, pool_pages)
    finally:
        torch.set_num_threads(threads)


def _microbench(config: LlamaConfig, num_pages: int, pool_pages: int) -> dict[str, Any]:
    pool = KVPool(
        config.num_layers,
        pool_pages,
        EngineConfig().page_size,
        config.num_kv_heads,
        config.head_dim,
        torch.float32,
        "cpu",
    )
    pool.kv.normal_()
    target = torch.empty_like(pool.kv[:, :, 0])
    sender, receiver = ZmqConnector("tcp://127.0.0.1:0"), ZmqConnector("tcp://127.0.0.1:0")
    seconds = dict.fromkeys(STAGES, 0.0)
    try:
        for i in range(num_pages + 8):  # the first 8 warm the connection up and are not counted
            times = handoff_one(pool, i % pool_pages, target, sender, receiver)
            if i >= 8:
                for stage, t in zip(STAGES, times, strict=True):
                    seconds[stage] += t
    finally:
        sender.close()
        receiver.close()
    total = sum(seconds.values())
    checksums = seconds["checksum"] + seconds["verify"]
    moved = num_pages * pool.kv[:, :, 0].numel() * pool.kv.element_size()
    return {
        "pages": num_pages,
        "bytes_per_page": moved // num_pages,
        "us_per_page": {stage: s / num_pages * 1e6 for stage, s in seconds.items()},
        "us_per_page_total": total / num_pages * 1e6,
        "checksum_share": checksums / total,
        "gb_per_s_with_checksums": moved / total / 1e9,
        "gb_per_s_without_checksums": moved / (total - checksums) / 1e9,
        "xxh3_gb_per_s": moved / seconds["checksum"] / 1e9,
    }


def handoff_one(
    pool: KVPool, page: int, target: torch.Tensor, sender: ZmqConnector, receiver: ZmqConnector
) -> list[float]:
    marks = [time.perf_counter()]
    payload = pool.kv[:, :, page].contiguous().cpu().numpy().tobytes()
    marks.append(time.perf_counter())
    checksum = xxhash.xxh3_64_intdigest(payload)
    marks.append(time.perf_counter())
    fields = {"request_id": "bench", "logical": 0, "page": page, "generation": 1, "slots": pool.page_size}
    sender.send(receiver.address, Message("page", {**fields, "checksum": checksum}, payload))
    marks.append(time.perf_counter())
    received = receiver.recv(10.0)
    assert received is not None and received[1].kind == "page"
    message = received[1]
    marks.append(time.perf_counter())
    assert xxhash.xxh3_64_intdigest(message.payload) == message.fields["checksum"]
    marks.append(time.perf_counter())
    data = torch.frombuffer(bytearray(message.payload), dtype=pool.kv.dtype).view(target.shape)
    target.copy_(data)
    marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)]


# ---- report ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=W1.num_requests)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=W1.max_tokens)
    parser.add_argument("--pages", type=int, default=1000, help="pages in the checksum microbenchmark")
    return parser.parse_args()


def w1_row(run: SystemRun) -> list[object]:
    idle = " ".join(f"{name} {v:.0f}" for name, v in run.idle_cpu_pct.items())
    return [*run_cells(run.result), idle]


def report(runs: list[SystemRun], rates: dict[str, float], micro: dict[str, Any]) -> None:
    print(
        "\nW1 through the HTTP API (ms columns). others %: CPU share of unrelated processes during the run."
    )
    print("idle CPU %: % of one core per server process (server, prefill, decode), with nothing in flight.")
    print_table([*RUN_HEADERS, "idle CPU %"], [w1_row(run) for run in runs])
    print("\nKV transfer (disaggregated run, from the audit trail). send: prefill's transfer_started ->")
    print("transfer_complete. end to end: transfer_started -> decode's last page_received (includes the wait")
    print("for decode's running step). decode burst: pages 2..n of a request / first -> last page_received.")
    print_table(
        [
            "requests",
            "pages",
            "MB moved",
            "send GB/s",
            "end-to-end GB/s",
            "e2e median req",
            "decode burst GB/s",
        ],
        [
            [
                rates["requests"],
                rates["pages"],
                rates["mb_moved"],
                rates["send_gb_per_s"],
                rates["end_to_end_gb_per_s"],
                rates["end_to_end_gb_per_s_median_request"],
                rates["decode_burst_gb_per_s"],
            ]
        ],
    )
    print(
        f"\nChecksum microbenchmark: {micro['pages']} pages of {micro['bytes_per_page']} bytes, us per page"
    )
    print_table(
        [*STAGES, "total", "checksum share %", "GB/s", "GB/s w/o checksums"],
        [
            [
                *(micro["us_per_page"][s] for s in STAGES),
                micro["us_per_page_total"],
                micro["checksum_share"] * 100,
                micro["gb_per_s_with_checksums"],
                micro["gb_per_s_without_checksums"],
            ]
        ],
    )


def main() -> None:
    args = parse_args()
    config, metadata = read_header(default_model_path())
    tokenizer = Tokenizer(metadata)
    prompts = make_prompts(tokenizer, args.requests, W1.prompt_len)
    warm = make_prompts(tokenizer, 2, 48, salt=-1)
    print(f"checksum microbenchmark over {args.pages} pages", flush=True)
    micro = checksum_microbench(config, args.pages)
    runs = []
    for label in SYSTEMS:
        print(f"{label}: {args.requests} requests at concurrency {args.concurrency}", flush=True)
        runs.append(run_system(label, prompts, warm, args.max_tokens, args.concurrency))
        print(f"  {runs[-1].result.tok_per_s:.1f} output tok/s", flush=True)
    rates = transfer_rates(runs[-1].trails, page_bytes(config))
    report(runs, rates, micro)
    write_json(
        "disagg",
        {
            "workload": {
                "prompt_len": W1.prompt_len,
                "max_tokens": args.max_tokens,
                "requests": args.requests,
            },
            "systems": {label: " ".join(["kvfence serve", *extra]) for label, extra in SYSTEMS.items()},
            "runs": [{**run.result.summary(), "idle_cpu_pct": run.idle_cpu_pct} for run in runs],
            "transfer": rates,
            "transfer_method": "audit trail: decode page_received x bytes per page / prefill transfer time",
            "checksum_microbench": micro,
        },
    )


if __name__ == "__main__":
    main()
