"""Each replica's kvfence series in Ray's own metrics, so that the Prometheus export of every Ray node (its
metrics agent, names prefixed `ray_`) carries them beside Ray Serve's, labelled by replica.

Contracts: every EXPORT_S a replica reads its own /metrics (kvfence.ray.fleet_views.FleetViews.local, with
its own key) and sets one Ray Serve Gauge per sample name to each sample's value; Ray Serve tags each with
`deployment`, `replica` and `application`. Gauges and counters only (a counter's total as a gauge: Ray's
counters take increments); histograms, summaries and a sample whose label names differ from its name's
first, or take a Serve tag's name, are left to /metrics. What Ray exports lags /metrics by up to EXPORT_S
plus Ray's report interval.
"""

from __future__ import annotations

import asyncio
import sys

from prometheus_client.parser import text_string_to_metric_families
from ray.serve.metrics import Gauge

from kvfence.ray.fleet_views import METRICS_PATH, FleetViews

EXPORT_S = 5.0
KINDS = ("gauge", "counter")
SERVE_TAGS = {"deployment", "replica", "application", "route"}


class RayExport:
    """One replica's series, mirrored into Ray Serve gauges."""

    def __init__(self, views: FleetViews) -> None:
        self.views = views
        self.gauges: dict[str, tuple[Gauge, tuple[str, ...]]] = {}

    async def run(self) -> None:
        """Mirror every EXPORT_S (forever: the task ends with the replica)."""
        while True:
            try:
                status, text = await self.views.local(METRICS_PATH)
                if status == 200:
                    self.mirror(text)
            except Exception as exc:  # a scrape that failed: the next one may not; /metrics stays the truth
                print(f"ray export: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            await asyncio.sleep(EXPORT_S)

    def mirror(self, text: str) -> None:
        for family in text_string_to_metric_families(text):
            if family.type not in KINDS:
                continue
            for sample in family.samples:
                if sample.name.endswith("_created"):  # a counter's start time, not a value
                    continue
                keys = tuple(sorted(sample.labels))
                if SERVE_TAGS & set(keys):
                    continue
                gauge, known = self.gauges.setdefault(
                    sample.name, (Gauge(sample.name, family.documentation, tag_keys=keys), keys)
                )
                if known == keys:
                    gauge.set(sample.value, tags=dict(sample.labels))
