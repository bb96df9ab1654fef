"""Does a Grafana dashboard find its data? Every PromQL expression of its panels, checked against a scrape
(`unanswered`, no Prometheus needed) or asked of a running Prometheus (`empty_in_prometheus`).

Contracts:
- `expressions(dashboard, variables)` lists each panel target's `expr` with the dashboard's variables
  (`$model_name`, `$replica`) and Grafana's interval (`$__rate_interval`) filled in.
- `unanswered(expr, exposition)` names each metric selector of `expr` that no sample of the exposition
  matches: the metric name, every `label="value"` matcher, every `label=~"regex"` matcher (the whole
  value, an absent label read as "", as Prometheus reads it), and every label the expression groups `by`.
  A selector with data passes even where the rest of the expression would be empty (a rate over one
  scrape is): the question is whether the series exist, with their labels.
- `empty_in_prometheus(url, expr)` is True when a Prometheus answers the instant query with no series.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_SELECTOR = re.compile(
    r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}|\b([a-zA-Z_:][a-zA-Z0-9_:]*_(?:total|sum|count|bucket|seconds|ratio|perc|running|waiting))\b(?!\s*\()"
)
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"]*)"')
_REGEX_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*=~\s*"([^"]*)"')
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
_FUNCTIONS = {"sum", "rate", "increase", "histogram_quantile", "by", "label_values"}


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: tuple[tuple[str, str], ...]  # equality matchers
    by: tuple[str, ...]  # labels the expression groups by: the series must carry them
    regexes: tuple[tuple[str, str], ...] = ()  # regex matchers

    def describe(self) -> str:
        matchers = ",".join([f'{k}="{v}"' for k, v in self.labels] + [f'{k}=~"{v}"' for k, v in self.regexes])
        return f"{self.metric}{{{matchers}}}" + (f" by ({', '.join(self.by)})" if self.by else "")


def expressions(dashboard: dict[str, Any], variables: dict[str, str], interval: str = "1m") -> list[str]:
    """Every panel target's expression, variables filled in."""
    found = []
    for panel in dashboard.get("panels", []):
        for target in panel.get("targets", []):
            expr = str(target.get("expr", ""))
            for name, value in (*variables.items(), ("__rate_interval", interval)):
                expr = expr.replace(f"${name}", value)
            found.append(expr)
    return found


def selectors(expr: str) -> list[Selector]:
    by = tuple(label.strip() for group in _BY.findall(expr) for label in group.split(",") if label.strip())
    found = []
    for match in _SELECTOR.finditer(expr):
        metric = match.group(1) or match.group(3)
        if metric in _FUNCTIONS:
            continue
        inside = match.group(2) or ""
        labels, regexes = tuple(_MATCHER.findall(inside)), tuple(_REGEX_MATCHER.findall(inside))
        found.append(Selector(metric, labels, by, regexes))
    return found


def _samples(exposition: str) -> Iterator[tuple[str, dict[str, str]]]:
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            yield sample.name, sample.labels


def unanswered(expr: str, exposition: str) -> list[str]:
    """The selectors of `expr` that no sample of `exposition` answers (described); [] when all have data."""
    samples = list(_samples(exposition))
    missing = []
    for selector in selectors(expr):
        wanted = dict(selector.labels)
        if not any(
            name == selector.metric
            and wanted.items() <= labels.items()
            and all(re.fullmatch(regex, labels.get(label, "")) for label, regex in selector.regexes)
            and all(label in labels for label in selector.by)
            for name, labels in samples
        ):
            missing.append(selector.describe())
    return missing


def empty_in_prometheus(url: str, expr: str, timeout_s: float = 30.0) -> bool:
    """Whether a Prometheus at `url` answers `expr` (an instant query) with no series."""
    response = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=timeout_s)
    response.raise_for_status()
    return not response.json()["data"]["result"]
