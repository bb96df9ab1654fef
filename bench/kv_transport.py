"""KV page transport microbenchmark: one-sided NIXL WRITE vs ZeroMQ page frames, for 16-page requests.

    .venv/bin/python bench/kv_transport.py [--pages 16] [--requests 20]

Both sides live in this process on real SmolLM2-size pages (30 layers x K/V x 16 slots x 3 KV heads x
64 dims, float32: 720 KiB a page), between two pools of 64 pages, one torch thread. Each request moves
`--pages` pages and is timed end to end the way the handoff does it, checks included:
  nixl  prefill hashes its source pages in place (xxh3_64, `KVPool.page_checksum`), posts one WRITE of
        every page's blocks (one descriptor per page, layer and K|V) into the granted target pages, polls
        until NIXL says DONE;
        decode hashes the pages now in its pool and compares (what `DecodeWorker._verify_one_sided` does);
  zmq   per page: prefill reads and hashes it, sends a `Page` frame over loopback TCP (plain, no CURVE)
        to a second connector; decode receives, parses, re-hashes and writes it into its pool.
UCX picks its own transport between the two agents of one process (shared memory here), so the NIXL row
is an upper bound for two processes on one host and says nothing about a network; `nixl_write_only` is
the WRITE alone (post -> DONE), without the checksums. Reports GB/s (pages x
bytes / time, median request) and per-page latency (median request time / pages); JSON on stdout and in
bench/results/kv_transport.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvfence.cache.pool import KVPool
from kvfence.disagg.connector import Received, ZmqConnector
from kvfence.disagg.messages import Bounds, Page, decode
from kvfence.disagg.nixl_transport import NixlAgent, nixl_available

SHAPE = (30, 2, 64, 16, 3, 64)  # SmolLM2-135M: layers, K|V, pages, slots, KV heads, head dim
RESULTS = Path(__file__).parent / "results" / "kv_transport.json"
WRITE_TIMES: list[float] = []  # NIXL post -> DONE alone, without the checksums on either side


def nixl_request(src: NixlAgent, dst: NixlAgent, peer: str, pools: tuple[KVPool, KVPool], n: int) -> float:
    source, target = pools
    pages = list(range(n))
    start = time.perf_counter()
    sums = [source.page_checksum(p) for p in pages]
    posted = time.perf_counter()
    write = src.write(peer, dst.layout, [(p, p + len(pages)) for p in pages], "bench")
    while src.poll(write) == "PROC":
        pass
    WRITE_TIMES.append(time.perf_counter() - posted)
    assert write.state == "DONE", write.state
    got = [target.page_checksum(p + len(pages)) for p in pages]
    elapsed = time.perf_counter() - start
    assert got == sums, "a page arrived different"
    return elapsed


def zmq_request(tx: ZmqConnector, rx: ZmqConnector, pools: tuple[KVPool, KVPool], n: int) -> float:
    source, target = pools
    bounds = Bounds(1 << 20, 1 << 20)
    start = time.perf_counter()
    for p in range(n):
        payload = source.page_bytes(p)
        tx.send(rx.address, Page("bench", p, p + n, 1, 16, xxhash.xxh3_64_intdigest(payload), payload))
    for _ in range(n):
        received = rx.recv(10.0)
        assert isinstance(received, Received)
        page = decode(received.header, received.payload, bounds)
        assert isinstance(page, Page) and xxhash.xxh3_64_intdigest(page.payload) == page.checksum
        target.load_page_bytes(page.page, page.payload)
    return time.perf_counter() - start


def summarize(times: list[float], pages: int, page_size: int) -> dict[str, float]:
    median = statistics.median(times)
    return {"gb_per_s": pages * page_size / median / 1e9, "per_page_ms": median / pages * 1e3}


def run(pages: int = 16, requests: int = 20) -> dict[str, Any]:
    """Both transports on the same pools; {transport: {gb_per_s, per_page_ms}} plus the page size."""
    torch.set_num_threads(1)
    layers, _, _, slots, heads, dim = SHAPE
    source, target = (KVPool(layers, pages * 4, slots, heads, dim, torch.float32, "cpu") for _ in range(2))
    source.kv.normal_()
    page_size = len(source.page_bytes(0))
    out: dict[str, Any] = {"pages_per_request": pages, "page_bytes": page_size, "requests": requests}
    tx, rx = ZmqConnector("tcp://127.0.0.1:0"), ZmqConnector("tcp://127.0.0.1:0")
    try:
        zmq_request(tx, rx, (source, target), pages)  # connect and warm up
        times = [zmq_request(tx, rx, (source, target), pages) for _ in range(requests)]
        out["zmq"] = summarize(times, pages, page_size)
    finally:
        tx.close()
        rx.close()
    if nixl_available():
        src, dst = NixlAgent("bench-prefill", source.kv), NixlAgent("bench-decode", target.kv)
        peer = src.add_peer(dst.metadata())
        nixl_request(src, dst, peer, (source, target), pages)  # connect and warm up
        times = [nixl_request(src, dst, peer, (source, target), pages) for _ in range(requests)]
        out["nixl"] = summarize(times, pages, page_size)
        out["nixl_write_only"] = summarize(WRITE_TIMES[1:], pages, page_size)
        out["nixl_over_zmq"] = out["nixl"]["gb_per_s"] / out["zmq"]["gb_per_s"]
        src.close()
        dst.close()
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"KV transport, {result['pages_per_request']}-page requests ({result['page_bytes']} B a page)"]
    lines.append(f"{'transport':16} {'GB/s':>8} {'ms/page':>9}")
    for name in ("nixl", "nixl_write_only", "zmq"):
        if name in result:
            row = result[name]
            lines.append(f"{name:16} {row['gb_per_s']:8.2f} {row['per_page_ms']:9.3f}")
    if "nixl_over_zmq" in result:
        lines.append(f"NIXL / zmq GB/s: {result['nixl_over_zmq']:.2f}x (target >= 2x)")
    else:
        lines.append("NIXL not installed: zmq only")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    result = run(args.pages, args.requests)
    print(table(result))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
