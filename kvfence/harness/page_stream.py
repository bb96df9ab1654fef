"""Page messages streamed prefill -> decode between two ZmqConnectors in this process (loopback TCP), CURVE
against plain, in GB/s received: what the transport alone costs, without the workers.

Contracts: at most IN_FLIGHT pages are sent and not yet received; the first `warm` pages (one at a time)
make the connection and are not timed; the transports alternate their order round by round and each figure
is the median of its rounds; both connectors are closed whatever happens.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvfence.disagg.messages import Page
from kvfence.harness.page_handoff import connector_pair, receive
from kvfence.harness.trail_transfer import page_bytes
from kvfence.model.gguf import ModelConfig

IN_FLIGHT = 64  # pages sent and not yet received, at most (below ZeroMQ's high-water marks of 1000)


def transport_microbench(config: ModelConfig, num_pages: int, rounds: int) -> dict[str, Any]:
    """GB/s of page messages streamed prefill -> decode over loopback TCP, CURVE vs plain, in alternating
    order round by round; each figure is the median of its rounds."""
    per_page = page_bytes(config)
    generator = torch.Generator().manual_seed(0)
    payloads = [  # real page-sized float32 data (random: nothing on the wire compresses it anyway)
        torch.randn(per_page // 4, generator=generator).numpy().tobytes() for _ in range(8)
    ]
    gb_per_s: dict[str, list[float]] = {"CURVE": [], "plain": []}
    for round_ in range(rounds):
        for transport in ("CURVE", "plain") if round_ % 2 == 0 else ("plain", "CURVE"):
            gb_per_s[transport].append(stream_pages(transport, payloads, num_pages))
    median = {transport: statistics.median(values) for transport, values in gb_per_s.items()}
    return {
        "pages": num_pages,
        "bytes_per_page": per_page,
        "in_flight": IN_FLIGHT,
        "rounds": rounds,
        "gb_per_s": gb_per_s,
        "gb_per_s_median": median,
        "curve_over_plain": median["CURVE"] / median["plain"],
    }


def stream_pages(transport: str, payloads: list[bytes], num_pages: int, warm: int = 16) -> float:
    """Send `num_pages` Page messages (the first `warm` ones, one at a time, make the connection and are
    not timed), keeping at most IN_FLIGHT unreceived; returns GB/s from the first send to the last receipt."""
    sender, receiver = connector_pair(transport)
    try:

        def send(i: int) -> None:
            payload = payloads[i % len(payloads)]
            sender.send(receiver.address, Page("bench", i, i % 64, 1, 0, payload))

        for i in range(warm):
            send(i)
            receive(receiver)
        sent = got = 0
        started = time.perf_counter()
        while got < num_pages:
            while sent < num_pages and sent - got < IN_FLIGHT:
                send(sent)
                sent += 1
            _header, payload = receive(receiver)
            assert len(payload) == len(payloads[0])
            got += 1
        elapsed = time.perf_counter() - started
    finally:
        sender.close()
        receiver.close()
    return num_pages * len(payloads[0]) / elapsed / 1e9
