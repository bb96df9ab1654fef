"""`kvfence audit`: the five acceptance checks of a running kvfence service, plus the black-box probes.

The probes (probes.py) drive the server over HTTP; with the admin key the command then reads every probe
request's audit trail (`GET /v1/audit/requests/{id}`) and `/metrics` (client.py), and checks:

1. pinned_versions        engine version, git commit, model file sha256, transport, start-up flags
                          (pinned.py);
2. capacity               the measured and advertised window fit each pool alone (checks.py, as are
                          the rest);
3. rejection_terminates   a refused request's trail holds `rejected` and nothing else happened;
4. complete_handoff       incomplete KV ends in an integrity abort with no content; a 200 rests on a
                          finished, fenced trail;
5. recycle_timing         a dropped stream is aborted, drained and released in order, no page is reused
                          while held, the pool drains, and a normal request succeeds afterwards;
plus tenant_pages         no request reads or shares a page of another tenant.

`--black-box` runs only the probes (for engines without an audit trail), as a tenant: the batch-invariance
declaration the replay probe holds the server to comes from its model card (`batch_invariant` in GET
/v1/models). Given an admin key as well, it reads the pin from `/v1/audit/info` instead, and the trails of
the requests whose answers changed, to name the pages they read. Output (report.py): a table on stdout, a
progress bar on stderr, `--json FILE`, and `--html FILE` (self-contained: inline CSS and SVG timelines of
every probe request's pages, the replay table beside them).

Exit status: 0 when every check passes, 1 when one fails, 2 on a usage or connection error, 3 when none
fails but one is INCONCLUSIVE: an audit that could not prove isolation must not read as a pass to a script.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kvfence.audit.checks import (
    check_capacity,
    check_handoff,
    check_recycle,
    check_rejections,
    check_tenant_pages,
)
from kvfence.audit.client import (
    AuditError,
    AuditReader,
    Served,
    Target,
    check_test_address,
    collect_trails,
    discover,
    wait_for_drained_pool,
)
from kvfence.audit.options import API_KEYS_ENV, add_arguments
from kvfence.audit.pinned import check_pinned
from kvfence.audit.probes import PROBE_STEPS, run_probes
from kvfence.audit.replay import declares_batch_invariance, mismatched_ids, name_pages
from kvfence.audit.report import (
    ProgressBar,
    Report,
    render_html,
    render_table,
    verdict_line,
)
from kvfence.audit.result import CheckResult
from kvfence.startup import StartupError, one_key, read_secret_file

NAMING_TIMEOUT_S = 2.0  # the changed replay answers finished long ago: their trails are settled or absent


def run(args: argparse.Namespace) -> int:
    """Run the audit; its exit status (the module docstring)."""
    url = str(args.url).rstrip("/").removesuffix("/v1")
    try:
        keys, args.admin_key = tenant_keys(args.api_key_file), admin_key(args.admin_key_file)  # resolved
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = _usage_problem(url, keys, args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        served = discover(url, keys[0])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        print(f"error: cannot list the models of {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    try:
        report = _audit(url, keys, served, args)
    except (httpx.HTTPError, AuditError) as exc:
        print(f"error: cannot audit {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    _write_outputs(report, args)
    print(render_table(report.results))
    print(verdict_line(report.results))
    return report.exit_status


def tenant_keys(path: Path | None) -> tuple[str, ...]:
    """The tenants' keys: from `path` (a key file: `read_secret_file`), else from $KVFENCE_AUDIT_API_KEYS."""
    if path is None:
        return tuple(os.environ.get(API_KEYS_ENV, "").split())
    lines = read_secret_file(path, "--api-key-file").splitlines()
    return tuple(key for line in lines if (key := line.partition("#")[0].strip()))


def admin_key(path: Path | None) -> str | None:
    if path is None:
        return os.environ.get("KVFENCE_ADMIN_KEY") or None
    return one_key(read_secret_file(path, "--admin-key-file"), f"--admin-key-file {path}")


def _usage_problem(url: str, keys: tuple[str, ...], args: argparse.Namespace) -> str | None:
    if len(keys) < 2:
        return f"give two tenants' keys (--api-key-file or ${API_KEYS_ENV}) for the tenant checks"
    if not args.black_box and not args.admin_key:
        return (
            "the admin key (--admin-key-file or $KVFENCE_ADMIN_KEY) reads audit trails (or use --black-box)"
        )
    try:
        check_test_address(url)
    except ValueError as exc:
        return str(exc)
    return None


def _audit(url: str, keys: tuple[str, ...], served: Served, args: argparse.Namespace) -> Report:
    steps = len(PROBE_STEPS) + (1 if args.black_box else 3)
    bar = ProgressBar(steps)
    model, advertised = args.model or served.model, served.window
    server = _server_info(url, args) if args.admin_key else None
    # The admin's pin where it can be read; else what the server tells every tenant.
    declared = declares_batch_invariance(server) if server is not None else served.batch_invariant
    probes = run_probes(Target(url, keys, model, args.timeout), advertised, bar, declared)
    target = {
        "url": url,
        "model": model,
        "advertised_window": advertised,
        "tenants": len(keys),
        "black_box": args.black_box,
        "batch_invariant_declared": declared,
    }
    report = Report(
        target, list(probes.results), probes.exchanges, boundary=probes.boundary, page_size=args.page_size
    )
    if not args.black_box:
        report.results += _white_box(url, args, report, bar, server)
    if args.admin_key:
        _name_replay_pages(url, args, report)
    bar("report")
    return report


def _server_info(url: str, args: argparse.Namespace) -> dict[str, Any] | None:
    """GET /v1/audit/info (None: the server has no such endpoint)."""
    reader = AuditReader(url, args.admin_key, args.timeout)
    try:
        return reader.info()
    finally:
        reader.close()


def _name_replay_pages(url: str, args: argparse.Namespace, report: Report) -> None:
    """Name the pages behind every changed replay answer: from the trails the white-box checks read, or
    (black-box) the trails of just those requests."""
    replay = next((r for r in report.results if r.name == "replay"), None)
    ids = mismatched_ids(replay) if replay else []
    if not replay or not ids:
        return
    if not report.trails:
        reader = AuditReader(url, args.admin_key, args.timeout)
        try:
            report.trails = collect_trails(reader, ids, timeout_s=NAMING_TIMEOUT_S)
        except AuditError:
            return  # no audit trail to read (not a kvfence server): the requests stay named by id
        finally:
            reader.close()
    name_pages(replay, report.trails)


def _white_box(
    url: str, args: argparse.Namespace, report: Report, bar: ProgressBar, server: dict[str, Any] | None
) -> list[CheckResult]:
    """The five acceptance checks and tenant_pages, from the probe requests' trails and /metrics."""
    reader = AuditReader(url, args.admin_key, args.timeout)
    try:
        bar("trails")
        ids = [str(e.request_id) for e in report.exchanges if e.request_id]
        report.trails = trails = collect_trails(reader, ids)
        pool = wait_for_drained_pool(reader)
    finally:
        reader.close()
    if server is not None:  # the server's own page size, not the auditor's guess
        report.page_size = next(iter(server["pools"].values()))["page_size"]
    bar("checks")
    recovery = next(r for r in report.results if r.name == "recovery")
    exchanges, advertised = report.exchanges, report.target["advertised_window"]
    return [
        check_pinned(server, args.model_file, report.target["model"], args.server_flags, trails),
        check_capacity(server, pool, report.boundary, advertised, report.page_size),
        check_rejections(exchanges, trails),
        check_handoff(exchanges, trails, args.expect_fault),
        check_recycle(exchanges, trails, pool, recovery),
        check_tenant_pages(trails),
    ]


def _write_outputs(report: Report, args: argparse.Namespace) -> None:
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=1, default=str), encoding="utf-8")
    if args.html:
        args.html.write_text(render_html(report), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvfence.audit.cli ...`: the same as `kvfence audit ...`."""
    parser = argparse.ArgumentParser(
        prog="kvfence audit", description="Acceptance checks of a kvfence server."
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
