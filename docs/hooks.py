"""mkdocs hooks (mkdocs.yml `hooks:`): the generated option reference, and links into the repository checked.

Contract: `on_page_markdown` replaces the `<!-- kvfence-options -->` marker of docs/options.md with
docs/gen_options.render() (the CLI's own parser, at build time: the page cannot drift from `--help`), and for
every page warns (a failure under `mkdocs build --strict`) about each link of the form `/PATH` (a path from
the repository's root, as GitHub resolves it) whose file or folder is not in the checkout: links to tests
and code outside docs/ rot loudly too. `docs/disaggregation.md` is `kvfence/disagg/README.md`, copied at
build time (`on_files`), so the protocol page has one source.
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

from mkdocs.structure.files import File

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))

import gen_options  # noqa: E402

log = logging.getLogger("mkdocs.hooks.kvfence")
REPO_LINK = re.compile(r"\]\((/[^)#\s]+)(#[^)\s]*)?\)")
DISAGG_SOURCE = ROOT / "kvfence" / "disagg" / "README.md"
DISAGG_PAGE = "disaggregation.md"


def on_files(files, config):
    """The disaggregation protocol page, generated from kvfence/disagg/README.md (one source)."""
    files.append(
        File.generated(config, DISAGG_PAGE, content=disagg_page(DISAGG_SOURCE.read_text(encoding="utf-8")))
    )
    return files


def disagg_page(text: str) -> str:
    """kvfence/disagg/README.md with its relative links made root-relative (`/kvfence/disagg/...`)."""

    def fix(match: re.Match[str]) -> str:
        target = match.group(1)
        if re.match(r"[a-z]+:|#|/", target):
            return match.group(0)
        resolved = (DISAGG_SOURCE.parent / target).resolve().relative_to(ROOT)
        return f"](/{resolved.as_posix()})"

    note = "*This page is `kvfence/disagg/README.md`, copied in when the site is built.*\n\n"
    return note + re.sub(r"\]\(([^)\s]+)\)", fix, text)


def on_page_markdown(markdown, page, config, files):
    if gen_options.MARKER in markdown:
        markdown = markdown.replace(gen_options.MARKER, gen_options.render())
    for match in REPO_LINK.finditer(markdown):
        target = match.group(1)
        if not (ROOT / target.lstrip("/")).exists():
            log.warning("%s links to %s, which is not in the repository", page.file.src_path, target)
    return markdown
