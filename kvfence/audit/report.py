"""The audit's report: a progress bar on stderr, the table of checks on stdout and the verdict line under
it (INCONCLUSIVE checks named apart: not failures, not passes), the JSON form, and one self-contained HTML
page (inline CSS, nothing fetched) with the replay table (each prompt's solo answer and its answers under
load, linked to their timelines) beside an SVG timeline of every probe request's pages: when each page was
allocated or shared, written, read (a foreign read in red), quarantined and released.
"""

from __future__ import annotations

import html
import json
import math
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvfence.audit.client import Exchange
from kvfence.audit.options import DEFAULT_PAGE_SIZE
from kvfence.audit.probes import Boundary
from kvfence.audit.result import INCONCLUSIVE, CheckResult
from kvfence.audit.trail import ACQUIRE, ENGINE, Event, Trail, by_where, event_pages, tenant_of


class ProgressBar:
    """`bar(step)` marks one more step done: `[#####.....] 3/8 step` on stderr."""

    def __init__(self, total: int, stream: TextIO = sys.stderr, width: int = 24) -> None:
        self.total, self.stream, self.width, self.done = total, stream, width, 0

    def __call__(self, step: str) -> None:
        self.done = min(self.total, self.done + 1)
        filled = self.width * self.done // self.total
        end = "\n" if self.done == self.total or not self.stream.isatty() else ""
        self.stream.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {step:<20}{end}"
        )
        self.stream.flush()


@dataclass
class Report:
    target: dict[str, Any]
    results: list[CheckResult]
    exchanges: list[Exchange]
    trails: dict[str, Trail] = field(default_factory=dict)
    boundary: Boundary | None = None
    page_size: int = DEFAULT_PAGE_SIZE

    @property
    def passed(self) -> bool:
        return all(r.passed is not False for r in self.results)

    @property
    def exit_status(self) -> int:
        """1: a check failed; 3: none failed, one is INCONCLUSIVE; 0: every check that ran passed."""
        if not self.passed:
            return 1
        return 3 if any(r.status == INCONCLUSIVE for r in self.results) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "passed": self.passed,
            "inconclusive": [r.name for r in self.results if r.status == INCONCLUSIVE],
            "checks": [r.to_dict() for r in self.results],
            "boundary": self.boundary.to_dict() if self.boundary else None,
            "exchanges": [e.summary() for e in self.exchanges],
            "trails": self.trails,
        }


def render_table(results: list[CheckResult], width: int = 110) -> str:
    """One line per check: name, PASS/FAIL/SKIP/INCONCLUSIVE, details (shortened to fit `width`)."""
    name_w = max(len(r.name) for r in results)
    status_w = max(6, *(len(r.status) for r in results))
    room = max(20, width - name_w - status_w - 6)
    lines = [
        f"  {'check':<{name_w}}  {'result':<{status_w}}  details",
        f"  {'-' * name_w}  {'-' * status_w}  {'-' * room}",
    ]
    for r in results:
        details = r.details if len(r.details) <= room else r.details[: room - 1] + "…"
        lines.append(f"  {r.name:<{name_w}}  {r.status:<{status_w}}  {details}")
    return "\n".join(lines)


def verdict_line(results: list[CheckResult]) -> str:
    """`audit FAILED: names`, `audit INCONCLUSIVE: names` (nothing failed, not everything proven) or
    `audit PASSED`; a failed audit still names its INCONCLUSIVE checks."""
    failing = [r.name for r in results if r.passed is False]
    unsure = [r.name for r in results if r.status == INCONCLUSIVE]
    unproven = f"INCONCLUSIVE (not failed, not proven): {', '.join(unsure)}"
    if failing:
        return f"audit FAILED: {', '.join(failing)}" + (f"; {unproven}" if unsure else "")
    return f"audit {unproven}" if unsure else "audit PASSED"


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
.PASS{background:#e5f5e0}.FAIL{background:#fee0d2}.SKIP{background:#eee}.INCONCLUSIVE{background:#fff3bf}
.changed{background:#fee0d2}.fenced{background:#fdd0a2}
pre{background:#f6f6f6;padding:8px;overflow:auto;max-height:24em}
section{margin:1.5em 0}h3{font-size:14px;margin:.3em 0}svg text{font:10px monospace}
"""


def render_html(report: Report) -> str:
    """The whole report as one self-contained HTML page (inline CSS and SVG, nothing fetched)."""
    status = "PASS" if report.passed else "FAIL"
    unsure = [r.name for r in report.results if r.status == INCONCLUSIVE]
    heading = f"{status}; INCONCLUSIVE: {', '.join(unsure)}" if unsure else status
    rows = "".join(
        f"<tr class='{r.status}'><td>{_e(r.name)}</td><td>{r.status}</td><td>{_e(r.details)}</td></tr>"
        for r in report.results
    )
    evidence = "".join(
        f"<details><summary>{_e(r.name)} ({len(r.evidence)})</summary>"
        f"<pre>{_e(json.dumps(r.evidence, indent=1, default=str))}</pre></details>"
        for r in report.results
        if r.evidence
    )
    target = _e(json.dumps(report.target, default=str))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvfence audit: {status}</title>"
        f"<style>{_CSS}</style></head><body><h1 class='{status}'>kvfence audit: {_e(heading)}</h1>"
        f"<p><code>{target}</code></p><table><tr><th>check</th><th>result</th><th>details</th></tr>{rows}</table>"
        f"<h2>Evidence</h2>{evidence or '<p>none</p>'}"
        f"<h2>Replay and page timelines</h2>{_replay_table(report)}{_legend()}{_timelines(report)}"
        "</body></html>"
    )


def _replay_rows(report: Report) -> list[dict[str, Any]]:
    """The replay check's per-prompt rows (replay.probe_rows), [] when it did not run."""
    replay = next((r for r in report.results if r.name == "replay"), None)
    return [item for item in replay.evidence if "replays" in item] if replay else []


def _replay_table(report: Report) -> str:
    """Each replay prompt: its answer alone, then each answer under load (same / changed / fenced), with
    the request ids whose timelines follow."""
    rows = _replay_rows(report)
    if not rows:
        return ""
    waves = max(len(row["replays"]) for row in rows)
    head = "<tr><th>prompt</th><th>key</th><th>alone</th>"
    head += "".join(f"<th>under load {i + 1}</th>" for i in range(waves)) + "</tr>"
    body = ""
    for row in rows:
        alone = f"{_e(row['solo'])} <code>{_e(row['solo_request_id'])}</code><br>{_e(repr(row['solo_text']))}"
        cells = "".join(
            f"<td class='{_e(r['verdict'])}'>{_e(r['verdict'])} <code>{_e(r['request_id'])}</code>"
            + (f"<br>{_e(repr(r['text']))}" if r["verdict"] == "changed" else "")
            + "</td>"
            for r in row["replays"]
        )
        prompt = f"<td>{row['probe']} ({_e(row['endpoint'])})</td><td>#{row['key']}</td>"
        body += f"<tr>{prompt}<td>{alone}</td>{cells}</tr>"
    return f"<h3>replay</h3><table>{head}{body}</table>"


def _replay_notes(report: Report) -> dict[str, str]:
    """request id -> its part in the replay check, for the timeline titles."""
    notes = {}
    for row in _replay_rows(report):
        if row["solo_request_id"]:
            notes[str(row["solo_request_id"])] = f"replay prompt {row['probe']} alone"
        for r in row["replays"]:
            notes[str(r["request_id"])] = f"replay prompt {row['probe']} under load: {r['verdict'].upper()}"
    return notes


def _timelines(report: Report) -> str:
    sections = []
    notes = _replay_notes(report)
    for e in report.exchanges:
        trail = report.trails.get(str(e.request_id)) if e.request_id else None
        if trail:
            title = f"{e.label} · key #{e.key_index} · {e.outcome} (HTTP {e.status}) · {e.request_id}"
            note = notes.get(str(e.request_id))
            title += f" · {note}" if note else ""
            sections.append(f"<section><h3>{_e(title)}</h3>{timeline_svg(trail, report.page_size)}</section>")
    return "".join(sections) or "<p>no audit trails (black-box run)</p>"


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


# ---- page timelines (SVG) ---------------------------------------------------------------------------

_COLORS = {
    "alloc": "#31a354",
    "share": "#17becf",
    "write": "#3182bd",
    "read": "#636363",
    "foreign": "#de2d26",
    "quarantine": "#e6550d",
    "release": "#000000",
    "held": "#c6dbef",
    "quarantined": "#fdd0a2",
}
_LABEL_W, _PLOT_W, _ROW_H, _TOP = 130, 720, 14, 22
MAX_TIMELINE_ROWS = 48


@dataclass
class PageLife:
    """One page's lifecycle within one request's trail: held spans, quarantine start, and markers."""

    spans: list[list[float]] = field(default_factory=list)  # [start, end] (end NaN while still held)
    quarantined_at: float | None = None
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (ts, mark kind, tooltip)


def page_lives(trail: Trail, page_size: int) -> dict[tuple[str, int], PageLife]:
    """(where, page) -> its life, from allocation (or prefix hit) through writes, reads, quarantine and
    release. Step writes are mapped to pages through the request's own record order."""
    lives: dict[tuple[str, int], PageLife] = defaultdict(PageLife)
    tenant = tenant_of(trail)
    for place, events in by_where(trail).items():
        record: list[int] = []
        for event in events:
            _apply(event, place, record, lives, tenant, page_size)
    return dict(lives)


def _apply(
    event: Event,
    place: str,
    record: list[int],
    lives: dict[tuple[str, int], PageLife],
    tenant: str | None,
    page_size: int,
) -> None:
    kind, ts, pages = event["kind"], float(event["ts"]), event_pages(event)
    tip = f"{kind} seq {event['seq']}"
    if kind in ACQUIRE:
        record += pages
        for p in pages:
            lives[(place, p)].spans.append([ts, math.nan])
            lives[(place, p)].marks.append((ts, "alloc" if kind == "pages_allocated" else "share", tip))
    elif kind == "step":
        pos, n = int(event.get("position", 0)), int(event.get("tokens", 0))
        for logical in range(pos // page_size, (pos + max(n, 1) - 1) // page_size + 1):
            if logical < len(record):
                lives[(place, record[logical])].marks.append(
                    (ts, "write", f"{tip} (tokens {pos}..{pos + n})")
                )
    elif kind in ("page_received", "validated"):
        for p in pages:
            lives[(place, p)].marks.append((ts, "write" if kind == "page_received" else "read", tip))
    elif kind == "pages_read":
        for p in event["pages"]:
            foreign = p["owner"] != tenant or p["last_writer"] != tenant
            lives[(place, int(p["page"]))].marks.append(
                (ts, "foreign" if foreign else "read", f"{tip} writer {p['last_writer']}")
            )
    elif kind == "quarantined":
        for p in pages:
            lives[(place, p)].quarantined_at = ts
            lives[(place, p)].marks.append((ts, "quarantine", tip))
    elif kind == "released":
        record.clear()
        for p in pages:
            life = lives[(place, p)]
            life.marks.append((ts, "release", tip))
            if life.spans and math.isnan(life.spans[-1][1]):
                life.spans[-1][1] = ts


def timeline_svg(trail: Trail, page_size: int) -> str:
    """Time runs left to right (ms since the request's first event). Top row: every event; then one row
    per page: a bar while held (orange once quarantined) with markers for allocate, write, read, release."""
    t0 = min(float(e["ts"]) for e in trail)
    t1 = max(float(e["ts"]) for e in trail)
    span = max(t1 - t0, 1e-3)
    lives = page_lives(trail, page_size)
    rows = sorted(lives, key=lambda k: (k[0], min((m[0] for m in lives[k].marks), default=0.0)))
    shown = rows[:MAX_TIMELINE_ROWS]
    height = _TOP + _ROW_H * (max(len(shown), 1) + 1) + 14

    def x(ts: float) -> float:
        return _LABEL_W + _PLOT_W * (ts - t0) / span

    parts = [_axis(span), *_event_row(trail, x)]
    for i, key in enumerate(shown):
        parts += _page_row(key, lives[key], _TOP + _ROW_H * (i + 1), x, t1)
    if len(rows) > len(shown):
        parts.append(_tag("text", f"… {len(rows) - len(shown)} more pages", x=4, y=height - 4))
    if not rows:
        parts.append(_tag("text", "no pages: nothing was allocated", x=_LABEL_W, y=_TOP + _ROW_H + 10))
    return _tag("svg", "".join(parts), xmlns=_SVG_NS, width=_LABEL_W + _PLOT_W + 50, height=height)


_SVG_NS = "http://www.w3.org/2000/svg"
_EVENT_COLORS = {
    "rejected": "#de2d26",
    "aborted": "#de2d26",
    "finished": "#31a354",
    "fault_injected": "#8856a7",
}


def _tag(name: str, body: str = "", **attrs: object) -> str:
    """An SVG element; attribute names use `_` for `-`, values are escaped, `body` is inserted as is."""
    text = "".join(
        f" {k.rstrip('_').replace('_', '-')}='{_e(f'{v:.1f}' if isinstance(v, float) else v)}'"
        for k, v in attrs.items()
    )
    return f"<{name}{text}>{body}</{name}>"


def _axis(span: float) -> str:
    ticks = []
    for i in range(6):
        x = _LABEL_W + _PLOT_W * i / 5
        ticks.append(_tag("line", x1=x, y1=_TOP - 6, x2=x, y2=_TOP - 2, stroke="#999"))
        ticks.append(_tag("text", f"{span * 1000 * i / 5:.0f} ms", x=x, y=_TOP - 9, text_anchor="middle"))
    return "".join(ticks)


def _event_row(trail: Trail, x: Callable[[float], float]) -> list[str]:
    parts = [_tag("text", "events", x=4, y=_TOP + 10)]
    hidden = ("ts", "seq", "kind", "request_id", "where")
    for event in trail:
        fields = json.dumps({k: v for k, v in event.items() if k not in hidden}, default=str)[:200]
        tip = _tag("title", _e(f"{event.get('where', '')} {event['kind']} seq {event['seq']} {fields}"))
        at = x(float(event["ts"]))
        color = _EVENT_COLORS.get(event["kind"], "#888")
        parts.append(
            _tag("line", tip, x1=at, y1=_TOP + 1, x2=at, y2=_TOP + _ROW_H - 1, stroke=color, stroke_width=2)
        )
    return parts


def _page_row(
    key: tuple[str, int], life: PageLife, y: int, x: Callable[[float], float], t_end: float
) -> list[str]:
    place, page = key
    parts = [_tag("text", _e(f"{place} p{page}" if place != ENGINE else f"page {page}"), x=4, y=y + 10)]
    for start, end in life.spans:
        still_held = math.isnan(end)
        stop = t_end if still_held else end
        q = life.quarantined_at
        q = q if q is not None and start <= q <= stop else stop
        parts.append(_bar(x(start), x(q), y, _COLORS["held"], still_held))
        if q < stop:
            parts.append(_bar(x(q), x(stop), y, _COLORS["quarantined"], still_held))
    for ts, mark, tip in life.marks:
        title = _tag("title", _e(f"{mark}: {tip}"))
        parts.append(
            _tag("rect", title, x=x(ts) - 2, y=y + 2, width=4, height=_ROW_H - 4, fill=_COLORS[mark])
        )
    return parts


def _bar(x0: float, x1: float, y: int, color: str, dashed: bool) -> str:
    """A held span; dashed outline when the page was still held at the trail's last event."""
    dash = {"stroke": "#e6550d", "stroke_dasharray": "3,2"} if dashed else {}
    return _tag("rect", x=x0, y=y + 3, width=max(x1 - x0, 1.0), height=_ROW_H - 6, fill=color, **dash)


def _legend() -> str:
    items = [("held", "held"), ("quarantined", "quarantined"), ("alloc", "allocate"), ("share", "prefix hit")]
    items += [("write", "write / receive"), ("read", "read (validated)"), ("foreign", "foreign read")]
    items += [("quarantine", "quarantine"), ("release", "release")]
    cells = "".join(
        _tag("rect", x=i * 110, y=2, width=10, height=10, fill=_COLORS[k])
        + _tag("text", _e(text), x=i * 110 + 14, y=11)
        for i, (k, text) in enumerate(items)
    )
    return _tag("svg", cells, xmlns=_SVG_NS, width=110 * len(items), height=16)
