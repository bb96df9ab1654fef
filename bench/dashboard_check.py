"""Ask a running Prometheus every expression of a Grafana dashboard, as Grafana would.

    .venv/bin/python bench/dashboard_check.py --prometheus http://127.0.0.1:9090 --model NAME \
        [--dashboard dashboards/grafana.json] [--interval 1m]

Point Prometheus at a kvfence server that has served traffic (scrape `/metrics`, with the admin key as
a bearer token when API keys are configured; `--metrics-compat vllm` for vLLM's own dashboard JSON), wait
two scrape intervals, then run this: one row per expression, with the number of series it returns. Exit
status 1 when any expression returns none. tests/unit/test_dashboard.py checks the same expressions
against a scrape without Prometheus.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvfence.harness.dashboard import empty_in_prometheus, expressions
from kvfence.harness.tables import print_table

DASHBOARD = Path(__file__).parents[1] / "dashboards" / "grafana.json"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prometheus", required=True, help="the Prometheus base URL")
    parser.add_argument("--model", required=True, help="the served model name ($model_name)")
    parser.add_argument("--dashboard", type=Path, default=DASHBOARD, help="the dashboard JSON")
    parser.add_argument("--interval", default="1m", help="what $__rate_interval stands for")
    parser.add_argument("--replica", default=".*", help="$replica, a regex (Grafana's All: every replica)")
    args = parser.parse_args()
    dashboard = json.loads(args.dashboard.read_text())
    found = expressions(dashboard, {"model_name": args.model, "replica": args.replica}, args.interval)
    empty = [expr for expr in found if empty_in_prometheus(args.prometheus, expr)]
    print_table(["expression", "data"], [[expr, "no" if expr in empty else "yes"] for expr in found])
    print(f"{len(found) - len(empty)} of {len(found)} expressions return data")
    return 1 if empty else 0


if __name__ == "__main__":
    sys.exit(main())
