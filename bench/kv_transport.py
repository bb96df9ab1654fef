"""KV page transport microbenchmark: sealed one-sided NIXL WRITEs vs ZeroMQ page frames, 16-page requests.

    .venv/bin/python bench/kv_transport.py [--pages 16] [--requests 20]

Two processes, as deployed: this one is the prefill side, a spawned child holds the decode pool. Real
SmolLM2-size pages (30 layers x K/V x 16 slots x 3 KV heads x 64 dims, float32: 720 KiB a page), pools
of 64 pages, one torch thread each. A request moves `--pages` pages and is timed end to end at the
prefill side, the way the handoff does it, checks included, until decode says the pages are in its pool:
  nixl  as deployed: each side's agent in its own landing process (`LandingAgent`), NIXL reading only
        prefill's send area and writing only decode's landing area. Prefill stages each page into its
        send slot, posts one WRITE (one descriptor per run of consecutive slots), polls until DONE and
        names the pages; decode waits for the WRITE's notification, takes each page from its landing
        slot, checks it, copies it into its pool and clears the slot (`DecodeWorker._copy_in`), answers.
        `aes-gcm`: the shipped path, each page sealed into its send slot (`seal_into`) and opened into
        a scratch buffer (`open_into`), as the workers do (cache/gcm.py's cipher: its kernel where the
        CPU has VAES, the GIL released); `aes-gcm held`: the same through cryptography's AESGCM;
        `xxh3`: the same landing and copy-in with an xxh3 checksum instead (no AEAD: what sealing costs).
        `runs`: source and target pages consecutive, as fresh pools hand them out; `scattered`: both
        drawn at random, one descriptor per page; `write only`: post -> DONE alone.
  nixl cma  the same with `--landing-cma`: both landing processes under one uid, dumpable to it, so that
        UCX moves pages by cross-memory attach instead of TCP (landing_identity.py says what it costs).
  zmq   per page: prefill reads and hashes it, sends a `Page` frame over loopback TCP; decode receives,
        parses, re-hashes and writes it into its pool, then answers. `curve` is the transport as shipped
        (every disaggregated socket is CURVE), `plain` the same without encryption.
The control answer travels over a pipe for every row alike. UCX picks its own transport between the two
processes (cross-memory attach on one host); a network changes the NIXL rows and says nothing here.
Reports GB/s (pages x bytes / median request time) and per-page latency; JSON on stdout and in
bench/results/kv_transport.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from collections import defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from kvfence.cache.gcm import backend
from kvfence.cache.pool import KVPool
from kvfence.disagg.connector import Received, ZmqConnector
from kvfence.disagg.decode import NIXL_POLL_S
from kvfence.disagg.keys import TransportKeys, ephemeral
from kvfence.disagg.landing import LandingAgent, interface_of
from kvfence.disagg.messages import Bounds, Page, decode
from kvfence.disagg.nixl_transport import area_shape, nixl_available
from kvfence.disagg.seal import TAG_BYTES, new_key, open_into, seal_into

SHAPE = (30, 64, 16, 3, 64)  # SmolLM2-135M: layers, pages, slots, KV heads, head dim
RESULTS = Path(__file__).parent / "results" / "kv_transport.json"
BOUNDS = Bounds(1 << 20, 1 << 20)
SEALS = ("aes-gcm", "aes-gcm held", "xxh3")  # held: cryptography's cipher, GIL held
ROWS = tuple(
    f"nixl{mode} {seal} {shape}{only}"
    for mode in ("", " cma")
    for seal in SEALS
    for shape in ("runs", "scattered")
    for only in ("", ", write only")
)
ROWS += ("zmq curve", "zmq plain")
KEY_FILE = "KVFENCE_BENCH_SEAL_KEY"  # the run's one key, given to the spawned decode side by environment
PREFILL, DECODE = "tcp://127.0.0.1:39151", "tcp://127.0.0.1:39152"  # fixed: CURVE's allow-list names them
CMA_UID = 0x4B550001  # the `nixl cma` rows' landing processes' one uid (--landing-uid)


def new_pool() -> KVPool:
    layers, pages, slots, heads, dim = SHAPE
    return KVPool(layers, pages, slots, heads, dim, torch.float32, "cpu")


def landing(name: str, pool: KVPool, cma: bool) -> LandingAgent:
    uid = CMA_UID if cma else None
    return LandingAgent(name, *area_shape(pool), interface_of("127.0.0.1"), uid, cma=cma)


def run_key() -> bytes:
    """This run's seal key: made once, inherited by the decode process (spawned: nothing else is)."""
    if KEY_FILE not in os.environ:
        os.environ[KEY_FILE] = new_key().hex()
    return bytes.fromhex(os.environ[KEY_FILE])


def stage(area: Any, pool: KVPool, source: int, target: int, seal: str) -> int:
    """Prefill's side of one page (PrefillWorker._post): its bytes sealed into its send slot, or copied
    there with their xxh3."""
    plain = pool.page_bytes(source)
    if seal.startswith("aes-gcm"):
        slot = area[source, : len(plain) + TAG_BYTES].data
        seal_into(run_key(), "bench", target, target, 1, plain, slot, kernel=seal == "aes-gcm")
        return 0
    area[source, : len(plain)] = memoryview(plain)
    return xxhash.xxh3_64_intdigest(plain)


def copy_in(area: Any, pool: KVPool, target: int, seal: str, checksum: int, scratch: Any) -> bool:
    """Decode's side of one page (DecodeWorker._copy_in): from its landing slot into a scratch copy,
    opened (or hashed), into the pool; the slot cleared."""
    size = pool.page_size * pool.token_bytes
    sealed, plain = scratch[0][: size + TAG_BYTES], scratch[1][:size]
    if seal.startswith("aes-gcm"):
        np.copyto(sealed, area[target, : size + TAG_BYTES])
        ok = open_into(run_key(), "bench", target, target, 1, sealed, plain.data, kernel=seal == "aes-gcm")
    else:
        np.copyto(plain, area[target, :size])
        ok = xxhash.xxh3_64_intdigest(plain) == checksum
    area[target] = 0
    if ok:
        pool.load_page_bytes(target, plain.data)
    return ok


def decode_side(
    conn: Connection, transport: str, keys: TransportKeys | None, address: str, cma: bool
) -> None:
    """The decode process: announce the landing area, then copy in each request the prefill side names."""
    torch.set_num_threads(1)
    pool = new_pool()
    agent = landing("bench-decode", pool, cma) if transport == "nixl" else None
    rx = ZmqConnector(address, keys) if agent is None else None
    conn.send((agent.metadata(), agent.layout) if agent else address)
    landed: list[Any] = []
    slot_bytes = pool.page_size * pool.token_bytes + TAG_BYTES
    scratch = (np.empty(slot_bytes, dtype=np.uint8), np.empty(slot_bytes - TAG_BYTES, dtype=np.uint8))
    while True:
        while agent is not None and not conn.poll(NIXL_POLL_S):
            landed += agent.notified()  # no progress thread: the decode worker polls its agent like this
        if (message := conn.recv()) is None:
            break
        if agent is not None:
            seal, targets, sums = message
            while not landed:  # DONE at prefill is not landed here: the WRITE's notification says so
                landed += agent.notified()
            landed.pop()
            pages = zip(targets, sums, strict=True)
            conn.send(all([copy_in(agent.area, pool, t, seal, c, scratch) for t, c in pages]))
            continue
        ok = True
        for _ in range(message):
            received = rx.recv(10.0)  # type: ignore[union-attr]
            assert isinstance(received, Received)
            page = decode(received.header, received.payload, BOUNDS)
            assert isinstance(page, Page)
            ok &= xxhash.xxh3_64_intdigest(page.payload) == page.checksum
            pool.load_page_bytes(page.page, page.payload)
        conn.send(ok)
    (agent or rx).close()  # type: ignore[union-attr]


def nixl_rows(
    conn: Connection, source: KVPool, pages: int, requests: int, cma: bool
) -> dict[str, list[float]]:
    metadata, layout = conn.recv()
    agent = landing("bench-prefill", source, cma)
    peer = agent.add_peer(metadata)
    rng = random.Random(0)
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(requests + 1):  # the first request connects and warms up
        runs = [(p, p + pages) for p in range(pages)]
        drawn = [rng.sample(range(SHAPE[1]), pages) for _ in range(2)]
        scattered = list(zip(*drawn, strict=True))
        for seal in SEALS:
            for shape, pairs in (("runs", runs), ("scattered", scattered)):
                name = f"nixl{' cma' if cma else ''} {seal} {shape}"
                start = time.perf_counter()
                sums = [stage(agent.area, source, s, t, seal) for s, t in pairs]
                posted = time.perf_counter()
                write = agent.write(peer, layout, pairs, "bench")
                while agent.poll(write) == "PROC":
                    pass
                done = time.perf_counter()
                assert write.state == "DONE", write.state
                conn.send((seal, [t for _, t in pairs], sums))
                assert conn.recv(), "a page arrived different"
                # The first request of each row pays the first use (UCX's connection, the pages' faults):
                # reported apart, never in the steady state's median.
                times[name if i else f"{name}, first request"].append(time.perf_counter() - start)
                if i:
                    times[f"{name}, write only"].append(done - posted)
    agent.close()
    return times


def zmq_times(
    conn: Connection, source: KVPool, pages: int, requests: int, keys: TransportKeys | None
) -> list[float]:
    peer = conn.recv()
    tx = ZmqConnector(PREFILL, keys)
    times: dict[str, list[float]] = defaultdict(list)
    for i in range(requests + 1):
        start = time.perf_counter()
        for p in range(pages):
            payload = source.page_bytes(p)
            tx.send(peer, Page("bench", p, p + pages, 1, xxhash.xxh3_64_intdigest(payload), payload))
        conn.send(pages)
        assert conn.recv(), "a page arrived different"
        times["steady" if i else "first request"].append(time.perf_counter() - start)
    tx.close()
    return times


def measure(
    transport: str, source: KVPool, pages: int, requests: int, curve: bool = False, cma: bool = False
) -> Any:
    keys = ephemeral([("prefill", "prefill", PREFILL), ("decode", "decode", DECODE)])
    rx_keys, tx_keys = (keys["decode"], keys["prefill"]) if curve else (None, None)
    here, there = mp.Pipe()
    args = (there, transport, rx_keys, DECODE, cma)
    child = mp.get_context("spawn").Process(target=decode_side, args=args)
    child.start()
    try:
        if transport == "nixl":
            return nixl_rows(here, source, pages, requests, cma)
        return zmq_times(here, source, pages, requests, tx_keys)
    finally:
        here.send(None)
        child.join(30)


def summarize(times: list[float], pages: int, page_size: int) -> dict[str, float]:
    median = statistics.median(times)
    return {"gb_per_s": pages * page_size / median / 1e9, "per_page_ms": median / pages * 1e3}


def run(pages: int = 16, requests: int = 20) -> dict[str, Any]:
    """Every row on the same source pool; {row: {gb_per_s, per_page_ms}}, the ratios and the page size."""
    torch.set_num_threads(1)
    run_key()  # before the decode side is spawned, so that it inherits the key
    source = new_pool()
    source.kv.normal_()
    page_size = len(source.page_bytes(0))
    out: dict[str, Any] = {"pages_per_request": pages, "page_bytes": page_size, "requests": requests}
    out["cipher"] = backend()
    first: dict[str, float] = {}
    for cma in (False, True) if nixl_available() else ():  # first: the zmq rows' CURVE threads must not
        for name, times in measure("nixl", source, pages, requests, cma=cma).items():  # share its process
            if name.endswith(", first request"):
                first[name.removesuffix(", first request")] = times[0] * 1e3
            else:
                out[name] = summarize(times, pages, page_size)
    for name, curve in (("zmq curve", True), ("zmq plain", False)):
        times = measure("zmq", source, pages, requests, curve=curve)
        out[name], first[name] = summarize(times["steady"], pages, page_size), times["first request"][0] * 1e3
    out["first_request_ms"] = first
    for nixl, shape in ((n, s) for n in ("nixl", "nixl cma") for s in ("runs", "scattered")):
        if f"{nixl} aes-gcm {shape}" not in out:
            continue  # NIXL not installed
        sealed = out[f"{nixl} aes-gcm {shape}"]["gb_per_s"]
        for zmq in ("zmq curve", "zmq plain"):
            out[f"{nixl} aes-gcm {shape} / {zmq}"] = sealed / out[zmq]["gb_per_s"]
        checksummed = out[f"{nixl} xxh3 {shape}"]["gb_per_s"]
        out[f"{nixl} aes-gcm {shape} / {nixl} xxh3 {shape}"] = sealed / checksummed
        held = out[f"{nixl} aes-gcm held {shape}"]["gb_per_s"]
        out[f"{nixl} aes-gcm held {shape} / zmq curve"] = held / out["zmq curve"]["gb_per_s"]
        out[f"{nixl} aes-gcm {shape} / {nixl} aes-gcm held {shape}"] = sealed / held
    return out


def table(result: dict[str, Any]) -> str:
    lines = [f"KV transport, {result['pages_per_request']}-page requests ({result['page_bytes']} B a page)"]
    lines.append(f"aes-gcm: {result['cipher']}")
    lines.append(f"{'transport':40} {'GB/s':>8} {'ms/page':>9}")
    for name in ROWS:
        if name in result:
            row = result[name]
            lines.append(f"{name:40} {row['gb_per_s']:8.2f} {row['per_page_ms']:9.3f}")
    first = result.get("first_request_ms", {})
    lines += [f"first request, {name}: {ms:.1f} ms" for name, ms in first.items()]
    ratios = [key for key in result if " / " in key]
    lines += [f"{key}: {result[key]:.2f}x" for key in ratios] or ["NIXL not installed: zmq only"]
    if ratios:
        lines.append("target: sealed NIXL (aes-gcm) >= 2x CURVE zmq GB/s for 16-page requests")
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
