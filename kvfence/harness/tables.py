"""Plain-text tables, as every benchmark script and the load harness's report print them.

Contract: columns are right-aligned to the widest cell or header; a float cell shows two decimals, any
other value its str(). One header line, one rule line of dashes, then one line per row.
"""

from __future__ import annotations

from collections.abc import Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return f"{value:.2f}" if isinstance(value, float) else str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in text]
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    print(format_table(headers, rows))
