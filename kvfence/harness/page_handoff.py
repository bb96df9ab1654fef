"""The handoff of one KV page timed stage by stage in one process, as the workers do it: prefill's read and
serialize and xxh3_64, a ZeroMQ send over loopback TCP, decode's receive and parse, xxh3_64 verification and
write; and what the checksums' share of that is.

Contracts: `connector_pair` gives a prefill-side sender and a decode-side receiver on free loopback ports,
CURVE with ephemeral keys (as `kvfence serve --disaggregated` gives its workers) or plain; `receive`
skips link events and, on CURVE, asserts that the sender was authenticated as the prefill worker;
`checksum_microbench` runs one torch thread (restored afterwards), its first 8 pages uncounted, and
closes both connectors whatever happens.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch
import xxhash

from kvfence.cache.pool import KVPool
from kvfence.config import EngineConfig
from kvfence.disagg.connector import LinkEvent, ZmqConnector
from kvfence.disagg.keys import ephemeral
from kvfence.disagg.launch import free_ports
from kvfence.disagg.messages import Bounds, Page, decode
from kvfence.harness.trail_transfer import page_bytes
from kvfence.model.gguf import ModelConfig

STAGES = ("serialize", "checksum", "send", "receive", "verify", "write")


def connector_pair(transport: str) -> tuple[ZmqConnector, ZmqConnector]:
    """A prefill-side sender and a decode-side receiver on loopback ports: CURVE with ephemeral keys, as
    `kvfence serve --disaggregated` gives its workers, or plain (no keys)."""
    prefill, decode_ = (f"tcp://127.0.0.1:{port}" for port in free_ports(2))
    keys = ephemeral([("prefill", "prefill", prefill), ("decode", "decode", decode_)])
    curve = transport == "CURVE"
    sender = ZmqConnector(prefill, keys["prefill"] if curve else None)
    receiver = ZmqConnector(decode_, keys["decode"] if curve else None)
    return sender, receiver


def receive(receiver: ZmqConnector, timeout_s: float = 30.0) -> tuple[bytes, bytes]:
    """The next frame pair (header, payload); link events are skipped. On CURVE the sender must have been
    authenticated as the prefill worker."""
    while True:
        item = receiver.recv(timeout_s)
        if item is None:
            raise TimeoutError(f"nothing received in {timeout_s:.0f} s")
        if isinstance(item, LinkEvent):
            continue
        assert item.role == ("prefill" if receiver.secure else None), item.role
        return item.header, item.payload


def checksum_microbench(
    config: ModelConfig, num_pages: int, transport: str, pool_pages: int = 64
) -> dict[str, Any]:
    """The handoff of `num_pages` pages, one after another, in this process: the same calls as
    PrefillWorker._send_pages and DecodeWorker's receive, parse, on_page and _write, each stage timed. One
    torch thread, as the disaggregated workers here run (with 2 threads on a busy machine the page copies
    alone take ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _microbench(config, num_pages, transport, pool_pages)
    finally:
        torch.set_num_threads(threads)


def _microbench(config: ModelConfig, num_pages: int, transport: str, pool_pages: int) -> dict[str, Any]:
    def pool() -> KVPool:
        shape = (config.num_layers, pool_pages, EngineConfig().page_size, config.num_kv_heads)
        return KVPool(*shape, config.head_dim, torch.float32, "cpu")

    source, target = pool(), pool()
    source.kv.normal_()
    bounds = Bounds(config.context_length, config.vocab_size)
    sender, receiver = connector_pair(transport)
    seconds = dict.fromkeys(STAGES, 0.0)
    try:
        for i in range(num_pages + 8):  # the first 8 warm the connection up and are not counted
            times = handoff_one(source, i % pool_pages, target, sender, receiver, bounds)
            if i >= 8:
                for stage, t in zip(STAGES, times, strict=True):
                    seconds[stage] += t
    finally:
        sender.close()
        receiver.close()
    total = sum(seconds.values())
    checksums = seconds["checksum"] + seconds["verify"]
    per_page = page_bytes(config)
    moved = num_pages * per_page
    return {
        "transport": transport,
        "pages": num_pages,
        "bytes_per_page": per_page,
        "us_per_page": {stage: s / num_pages * 1e6 for stage, s in seconds.items()},
        "us_per_page_total": total / num_pages * 1e6,
        "checksum_share": checksums / total,
        "gb_per_s_with_checksums": moved / total / 1e9,
        "gb_per_s_without_checksums": moved / (total - checksums) / 1e9,
        "xxh3_gb_per_s": moved / seconds["checksum"] / 1e9,
        "send_receive_gb_per_s": moved / (seconds["send"] + seconds["receive"]) / 1e9,
    }


def handoff_one(
    source: KVPool, page: int, target: KVPool, sender: ZmqConnector, receiver: ZmqConnector, bounds: Bounds
) -> list[float]:
    marks = [time.perf_counter()]
    payload = source.page_bytes(page)
    marks.append(time.perf_counter())
    checksum = xxhash.xxh3_64_intdigest(payload)
    marks.append(time.perf_counter())
    sender.send(receiver.address, Page("bench", 0, page, 1, checksum, payload))
    marks.append(time.perf_counter())
    message = decode(*receive(receiver), bounds)
    assert isinstance(message, Page)
    marks.append(time.perf_counter())
    assert xxhash.xxh3_64_intdigest(message.payload) == message.checksum
    marks.append(time.perf_counter())
    target.load_page_bytes(message.page, message.payload)
    marks.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(marks)]
