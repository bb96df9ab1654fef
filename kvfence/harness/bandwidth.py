"""Memory bandwidth ceilings for decode: what torch threads read of a large array, and what the decode
matmul reads of a model's weights at one row, in GB/s.

Contracts: each figure is the best of `repeats`; torch's thread count is restored afterwards, whatever
happens; `decode_matmul_bandwidth` is (0, 0) when neither the packed nor the 16-bit kernel runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvfence.model.transformer import Transformer


def read_bandwidth(threads: int, size: int = 1 << 30, repeats: int = 5) -> float:
    """GB/s at which `threads` torch threads read a 1 GiB float32 array (a sum: one pass, no writes), the
    best of `repeats`: the ceiling a decode step reading every weight once can approach."""
    data = torch.ones(size // 4)
    return size / best_seconds(data.sum, threads, repeats) / 1e9


def decode_matmul_bandwidth(model: Transformer, threads: int, repeats: int = 5) -> tuple[float, float]:
    """(GB/s, MB read) of the decode matmul at one row over every projection of the model (a decode step's
    weights, the LM head included), as the C decoder layer runs it: packed codes through the packed kernel,
    16-bit weights through the 16-bit kernel over every thread; the best of `repeats`; (0, 0) when neither
    kernel runs."""
    projections = [p for layer in model.layers for p in layer.projections()] + [model.lm_head]
    calls, read = [], 0
    if model.packed_matmul is not None:
        packed = [p.packed for p in projections if p.packed is not None]
        read += sum(w.codes.numel() + 4 * (w.scales.numel() + w.offsets.numel()) for w in packed)
        calls += [(model.packed_matmul, w, w.in_features, {}) for w in packed]
    if model.half_matmul is not None:
        half = [p.half for p in projections if p.half is not None]
        read += sum(2 * w.panels.numel() for w in half)
        calls += [(model.half_matmul, w, w.in_features, {"split": True}) for w in half]
    if not calls:
        return 0.0, 0.0
    rows = {width: torch.randn(1, width) for _, _, width, _ in calls}

    def step() -> None:
        for kernel, weight, width, options in calls:
            kernel(rows[width], weight, **options)

    return read / best_seconds(step, threads, repeats) / 1e9, read / 1e6


def best_seconds(run: Callable[[], object], threads: int, repeats: int) -> float:
    """The fastest of `repeats` calls of `run` on `threads` torch threads (torch's count restored after)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - started)
    finally:
        torch.set_num_threads(previous)
    return best
