"""What CURVE costs a disaggregated deployment against the plain transport: each transport's runs
summarised over their rounds, then compared.

Contracts: a summary's output tok/s and others' CPU share are means over its rounds, its TTFT percentiles
over every request of every round, its transfer rates those of the pooled trails (trail_transfer.py);
`compare` is JSON-ready: the cost 1 - CURVE / plain output tok/s against CURVE_COST_TARGET (`passed`),
and `contended` where others used more than CONTENDED of the CPUs during either transport's runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvfence.harness.contention import CONTENDED
from kvfence.harness.served_systems import SystemRun
from kvfence.harness.trail_transfer import transfer_rates

CURVE_COST_TARGET = 0.10  # CURVE may cost at most this share of the plain transport's output tok/s


@dataclass
class TransportSummary:
    """One disaggregated transport over its rounds: output tok/s (mean of the rounds), TTFT over every
    request of every round, others' CPU share (mean), and the transfer rates of the pooled trails."""

    transport: str
    runs: int
    tok_per_s: float
    ttft_p50_s: float
    ttft_p95_s: float
    foreign_cpu: float
    rates: dict[str, float]


def summarize(runs: list[SystemRun], transport: str, bytes_per_page: int) -> TransportSummary:
    mine = [run for run in runs if run.transport == transport]
    ttfts = [t.ttft for run in mine for t in run.result.timings]
    return TransportSummary(
        transport,
        len(mine),
        statistics.mean(run.result.tok_per_s for run in mine),
        float(np.percentile(ttfts, 50)),
        float(np.percentile(ttfts, 95)),
        statistics.mean(run.result.foreign_cpu for run in mine),
        transfer_rates([trail for run in mine for trail in run.trails], bytes_per_page),
    )


def compare(curve: TransportSummary, plain: TransportSummary) -> dict[str, Any]:
    """CURVE against the plain transport: what it costs in output tok/s, and the ratios of the rest."""
    cost = 1 - curve.tok_per_s / plain.tok_per_s
    ratio = {
        key: curve.rates[f"{key}_gb_per_s"] / plain.rates[f"{key}_gb_per_s"]
        for key in ("send", "end_to_end", "decode_burst")
    }
    return {
        "output_tok_per_s": {"CURVE": curve.tok_per_s, "plain": plain.tok_per_s},
        "curve_cost_pct": cost * 100,
        "target_pct": CURVE_COST_TARGET * 100,
        "passed": cost <= CURVE_COST_TARGET,
        "ttft_p50_ms": {"CURVE": curve.ttft_p50_s * 1e3, "plain": plain.ttft_p50_s * 1e3},
        "ttft_p95_ms": {"CURVE": curve.ttft_p95_s * 1e3, "plain": plain.ttft_p95_s * 1e3},
        "transfer_gb_per_s_curve_over_plain": ratio,
        "foreign_cpu": {"CURVE": curve.foreign_cpu, "plain": plain.foreign_cpu},
        "contended": max(curve.foreign_cpu, plain.foreign_cpu) > CONTENDED,
        "rounds": curve.runs,
    }
