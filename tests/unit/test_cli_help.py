"""`--help` tells an operator what runs: every option that defaults to something says so, in units a
person reads, and every `kvfence serve` option has a row in the options table of docs/configuration.md (so
the table cannot drift from the parser again); and building the parser loads no command's libraries."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvfence.cli import build_parser

README = Path(__file__).parents[2] / "docs" / "configuration.md"  # the options table (from README.md)
OPTIONS_HEADING = "## Options (`kvfence serve --help`)"


def subcommand(name: str) -> argparse.ArgumentParser:
    """The parser of `kvfence NAME` (`keys generate` for 'keys generate')."""
    parser = build_parser()
    for word in name.split():
        actions = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = next(actions).choices[word]
    return parser


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def readme_options() -> set[str]:
    """The flags named in the first column of the options table (docs/configuration.md)."""
    section = README.read_text().split(OPTIONS_HEADING, 1)[1]
    rows = re.findall(r"^\|([^|]*(?:\\\|[^|]*)*)\|", section.split("\n\n", 2)[1], flags=re.MULTILINE)
    return {flag for row in rows for flag in re.findall(r"--[a-z][a-z0-9-]*", row)}


def test_every_serve_option_is_in_the_readme_table() -> None:
    """Every option `--help` shows (a retired one that only refuses itself, such as `--admin-key`, is
    hidden there and named in its successor's row instead)."""
    table = readme_options()
    flags = {a.option_strings[0] for a in options(subcommand("serve")) if a.help != argparse.SUPPRESS}
    assert not flags - table, f"serve options missing from README's options table: {sorted(flags - table)}"
    assert not table - flags, f"README's table names options serve does not have: {sorted(table - flags)}"


@pytest.mark.parametrize("name", ["serve", "router", "generate", "keys generate"])
def test_every_default_is_in_the_help(name: str) -> None:
    """An option with a default value states it; a switch (False) or an absent value (None) needs not."""
    silent = [
        a.option_strings[0]
        for a in options(subcommand(name))
        if a.default not in (None, False, argparse.SUPPRESS) and "default" not in (a.help or "")
    ]
    assert not silent, f"`kvfence {name}` options whose help hides their default: {silent}"


def test_sizes_are_shown_in_human_units() -> None:
    text = subcommand("serve").format_help()
    assert "(default: 512 MiB)" in text and "536870912" not in text


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["audit", "--help"], ["router", "--help"]])
def test_help_loads_no_torch(argv: list[str]) -> None:
    """`kvfence ... --help` answers at once: in a fresh interpreter, building the parser and printing the
    help leave torch (and the engine) out of sys.modules."""
    code = (
        "import sys\n"
        "from kvfence.cli import main\n"
        "try:\n"
        f"    main({argv!r})\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        "heavy = ('torch', 'kvfence.engine', 'kvfence.model', 'kvfence.cache')\n"
        "assert not [m for m in heavy if m in sys.modules], [m for m in heavy if m in sys.modules]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage: kvfence" in done.stdout


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["serve", "--audit-lo", "x.jsonl"], "unrecognized arguments: --audit-lo"),
        (["serve", "--api-key", "sk-x"], "pass --api-keys FILE, or set $VLLM_API_KEY"),  # vLLM's spelling
        (["serve", "--allowed-origins", "https://a.example/path"], "must be * or an origin"),
    ],
)
def test_no_abbreviations_and_origins_checked(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unambiguous prefix is not taken for an option (`--audit-lo` would become `--audit-log`); vLLM's
    `--api-key KEY` is refused naming what replaces it (tests/unit/test_vllm_api_key.py)."""
    with pytest.raises(SystemExit) as exit:
        build_parser().parse_args(argv)
    assert exit.value.code == 2 and error in capsys.readouterr().err
    parsed = build_parser().parse_args(["serve", "--allowed-origins", "*", "https://a.example:8443"])
    assert parsed.allowed_origins == ["*", "https://a.example:8443"]


def test_the_parser_every_command_builds_loads_no_audit_client() -> None:
    """`kvfence serve` builds the whole parser, `audit` included: the audit's HTTP client (httpx, with rich
    and pygments, ~10 MiB resident) loads only when `kvfence audit` runs."""
    code = (
        "import sys\n"
        "from kvfence.cli import build_parser\n"
        "args = build_parser().parse_args(['audit', '--url', 'http://127.0.0.1:9'])\n"
        "print('httpx' in sys.modules, args.run.__module__)\n"
        "import kvfence.audit.cli\n"
        "print('httpx' in sys.modules)"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["False", "kvfence.cli", "True"], run.stderr[-2000:]
