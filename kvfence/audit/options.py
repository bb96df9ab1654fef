"""`kvfence audit`'s command line: its options, declared without loading the audit itself.

Why a module of its own: `kvfence` builds every subcommand's parser at start, `kvfence serve` included, and
the audit's modules bring its HTTP client (httpx, and through it rich and pygments): 9.8 MiB resident on
their own, in a server that never audits. `kvfence audit` loads them when it runs (cli.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvfence.startup import SecretOnCommandLine

API_KEYS_ENV = "KVFENCE_AUDIT_API_KEYS"
DEFAULT_PAGE_SIZE = 16  # tokens per KV page, for a server that does not report its own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `kvfence audit` options."""
    parser.add_argument("--url", required=True, help="server base URL (loopback or private test address)")
    parser.add_argument(
        "--api-key-file",
        type=Path,
        metavar="FILE",
        help="tenants' keys, one per line (at least two tenants; '#' starts a comment), in a file only you "
        f"can read (chmod 600) (default: ${API_KEYS_ENV}, whitespace-separated)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        metavar="FILE",
        help="the server's admin key, alone on one line, in a file only you can read (reads audit trails; "
        "with --black-box: only its pins and the trails of changed answers) (default: $KVFENCE_ADMIN_KEY)",
    )
    for retired in ("--api-key", "--admin-key"):  # a command line is readable by every local user
        parser.add_argument(
            retired, nargs="?", action=SecretOnCommandLine, default=argparse.SUPPRESS, help=argparse.SUPPRESS
        )
    parser.add_argument("--model", help="model id (default: the first one /v1/models lists)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the full report as JSON")
    parser.add_argument(
        "--html", type=Path, metavar="FILE", help="write a self-contained HTML report with page timelines"
    )
    parser.add_argument(
        "--black-box", action="store_true", help="only the HTTP probes (engines without an audit trail)"
    )
    parser.add_argument(
        "--model-file", type=Path, help="the GGUF file served, for its sha256 (default: the packaged model)"
    )
    parser.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help="tokens per KV page, for a server without /v1/audit/info (default: %(default)s)",
    )
    parser.add_argument("--server-flags", help="the server's start-up flags, recorded as given")
    parser.add_argument(
        "--expect-fault",
        action="append",
        default=[],
        metavar="NAME",
        help="a fault armed on the server: it must be caught (repeatable; default: none)",
    )
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per request (default: %(default)s)"
    )
