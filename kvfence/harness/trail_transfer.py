"""The KV transfer rate of disaggregated requests, read from their audit trails: bytes = decode's
`page_received` events x bytes per page, over prefill's send time (transfer_started -> transfer_complete),
the end to end time (transfer_started -> decode's last page_received) and decode's burst (pages 2..n over
its first -> last page_received).

Contract: `transfer_rates` pools every trail given (each must hold prefill's transfer_started and
transfer_complete and at least one decode page_received, tagged by `where` as the router's trail is);
GB/s are 1e9 bytes per second; a burst of no time is NaN.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvfence.cache.pool import KVPool
from kvfence.config import EngineConfig
from kvfence.model.gguf import ModelConfig


def page_bytes(config: ModelConfig) -> int:
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
