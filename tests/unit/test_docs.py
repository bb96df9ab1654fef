"""The docs cannot drift: the generated option reference (docs/gen_options.py) lists every option
`kvfence.cli.build_parser()` defines, a refused secret option with the file or variable to use instead;
every root-relative link in docs/ (`/tests/...`, `/kvfence/...`) names a file the repository has; and the
README stays a first screen: under 200 lines, the two commands first."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[2]
DOCS = ROOT / "docs"


def gen_options() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_options", DOCS / "gen_options.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_option_reference_lists_every_option_of_every_subcommand() -> None:
    module = gen_options()
    page = module.render()
    section = r"^## `(kvfence[^`]*)`\n(.*?)(?=^## `|\Z)"
    sections = dict(re.findall(section, page, flags=re.MULTILINE | re.DOTALL))
    flags = module.option_strings()
    assert set(sections) == set(flags) >= {"kvfence serve", "kvfence router", "kvfence audit"}
    for name, options in flags.items():
        missing = [flag for flag in options if f"`{flag}" not in sections[name]]
        assert not missing, f"{name}: options missing from the generated reference: {missing}"


def test_a_refused_secret_option_names_what_to_use_instead() -> None:
    page = gen_options().render()
    serve = page.split("## `kvfence serve`", 1)[1].split("## `", 1)[0]
    assert re.search(r"\| `--api-key` \| .*--api-keys FILE.*\$VLLM_API_KEY", serve)
    assert re.search(r"\| `--admin-key` \| .*--admin-key-file FILE.*\$KVFENCE_ADMIN_KEY", serve)


def test_the_options_page_carries_the_marker_the_hook_replaces() -> None:
    assert gen_options().MARKER in (DOCS / "options.md").read_text()


def test_every_root_relative_link_in_the_docs_names_a_file_of_the_repository() -> None:
    broken = [
        f"{page.name}: {target}"
        for page in sorted(DOCS.glob("*.md"))
        for target in re.findall(r"\]\((/[^)#\s]+)", page.read_text())
        if not (ROOT / target.lstrip("/")).exists()
    ]
    assert not broken, f"links to files the repository lacks: {broken}"


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 200
    first_block = text.split("```sh\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in first_block[:2]] == [["make", "serve"], ["make", "test"]]
