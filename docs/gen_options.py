"""The configuration reference, generated from the CLI's own parser so that it cannot drift.

Contract: `render()` builds `kvfence.cli.build_parser()` and returns Markdown with one section per
subcommand (`kvfence serve`, `kvfence router`, `kvfence keys generate`, `kvfence audit`, `kvfence lab`,
`kvfence generate`) and one table row per option: its flags (or metavar for a positional), its default and
its help text exactly as `--help` prints them (argparse's `%(default)s` expanded). Options that refuse a
secret on the command line (hidden from `--help`: `--admin-key`, `--api-key`) get a table of their own
with the refusal the parser itself prints, so the page names the file or environment variable to use.
`option_strings()` lists every flag the parser defines, for tests/unit/test_docs.py.

Imports kvfence.cli only (light modules at its top; no torch, no model). Run as a script it prints the
page; `mkdocs build` calls it through docs/hooks.py, which puts the result into docs/options.md in place
of the `<!-- kvfence-options -->` marker.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's kvfence when run directly

from kvfence.cli import build_parser
from kvfence.startup import ApiKeyOnCommandLine, SecretOnCommandLine

MARKER = "<!-- kvfence-options -->"
REFUSING = (SecretOnCommandLine, ApiKeyOnCommandLine)


def subcommands(
    parser: argparse.ArgumentParser, prefix: str = "kvfence"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every leaf subcommand as ('kvfence serve', its parser), in the parser's order."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from subcommands(sub, f"{prefix} {name}")
            return
    yield prefix, parser


def _cell(text: str) -> str:
    """One table cell: one line, and Markdown's active characters shown as written (`<think>` is no tag)."""
    text = " ".join(text.split())
    for char, escaped in (("&", "&amp;"), ("<", "&lt;"), (">", "&gt;"), ("|", "\\|"), ("*", "\\*")):
        text = text.replace(char, escaped)
    return text


def _flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}` (positional)"
    metavar = ""
    if action.nargs != 0:
        metavar = " " + (action.metavar or (action.dest.upper() if not action.choices else ""))
        if action.choices and not action.metavar:
            metavar = " " + "\\|".join(str(c) for c in action.choices)
    return ", ".join(f"`{flag}{metavar.rstrip()}`" for flag in action.option_strings)


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.default in (None, argparse.SUPPRESS) or action.default == []:
        return "none"
    if action.default is False and action.nargs == 0:
        return "off"
    return f"`{action.default}`"


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:
        text = parser._get_formatter()._expand_help(action)
    return _cell(text)


def refusal(parser: argparse.ArgumentParser, action: argparse.Action, flag: str) -> str:
    """What the parser prints when `flag` is given on the command line (parser.error, captured)."""
    stderr = io.StringIO()
    try:
        with redirect_stderr(stderr):
            action(parser, argparse.Namespace(), "KEY", flag)
    except SystemExit:
        pass
    line = stderr.getvalue().strip().splitlines()[-1]
    return line.split(": error: ", 1)[-1] if ": error: " in line else line


def option_strings() -> dict[str, list[str]]:
    """Every flag each subcommand defines (refused ones included), '--help' left out."""
    found = {}
    for name, parser in subcommands(build_parser()):
        flags = [flag for action in parser._actions for flag in action.option_strings]
        found[name] = [flag for flag in flags if flag not in ("-h", "--help")]
    return found


def render() -> str:
    out: list[str] = []
    for name, parser in subcommands(build_parser()):
        out += [f"## `{name}`", ""]
        if parser.description or parser.format_usage():
            out += ["```text", parser.format_usage().strip(), "```", ""]
        rows, refused = [], []
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            if isinstance(action, REFUSING):
                refused += [(flag, refusal(parser, action, flag)) for flag in action.option_strings]
                continue
            if action.help == argparse.SUPPRESS:
                continue
            rows.append(f"| {_flags(action)} | {_default(action)} | {_help(parser, action)} |")
        out += ["| option | default | help |", "|---|---|---|", *rows, ""]
        if refused:
            out += [
                "Refused on the command line (a command line is readable by every local user through "
                "`/proc/PID/cmdline`), with what to use instead, as the parser says it:",
                "",
                "| option | what the parser answers |",
                "|---|---|",
                *(f"| `{flag}` | {_cell(message)} |" for flag, message in refused),
                "",
            ]
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
