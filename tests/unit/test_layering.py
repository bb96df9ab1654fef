"""The house has floors: a module may import only from its own package or from a lower floor; and no
module imports itself round a circle.

This is what keeps the hot path (cache/, engine/) free of tools, and the HTTP-only audit client free of
torch. The test reads every import statement (function-level and TYPE_CHECKING ones too) with `ast`, so a
new upward import or a new circle fails here instead of in a review. A circle through a function-level or
TYPE_CHECKING import counts: deferring one side is how a circle hides, not how it is broken.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import kvfence

ROOT = Path(kvfence.__file__).parent
# Bottom to top. Packages on one floor may not import each other either.
FLOORS: list[set[str]] = [
    {"units", "pins", "config", "sampling", "trail", "startup", "lifetime"},
    {"model"},
    {"cache", "grammar"},  # grammar: structured output (llguidance), under the request that holds it
    {"request"},
    {"engine"},
    {"disagg", "api"},
    {"harness"},
    {"audit"},
    {"cli_model"},  # the model a command names, its header read before any weight
    {"cli_checks"},
    {"cli_http"},  # the HTTP option group, under the parsers that hold it
    {"cli_options"},
    {"ray"},  # Ray Serve: replicas built by the serve parser and checks below; `cli` starts it lazily
    {"offline"},  # vLLM's LLM: an entry point like the CLI, resolving --model's names as it does
    {"cli"},
    {"__main__"},  # `python -m kvfence`
    {"__init__"},  # `from kvfence import LLM`: the package's names, loaded on first use
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def unit_of(module: str) -> str:
    """'kvfence.cache.pool' -> 'cache'; 'kvfence.cli' -> 'cli'."""
    return module.split(".")[1]


def kvfence_imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] if node.module != "kvfence" else [f"kvfence.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.startswith("kvfence.")]
    return found


def test_every_module_has_a_floor() -> None:
    units = {p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or p.is_dir()}
    units -= {"__init__", "__pycache__", "csrc"}
    assert units <= set(FLOOR), f"modules without a floor: {sorted(units - set(FLOOR))}"


def test_no_module_imports_a_higher_floor() -> None:
    upward = []
    for path in sorted(ROOT.rglob("*.py")):
        here = unit_of("kvfence." + ".".join(path.relative_to(ROOT).with_suffix("").parts))
        for line, module in kvfence_imports(path):
            there = unit_of(module)
            if there != here and FLOOR[there] >= FLOOR[here]:
                upward.append(f"{path.relative_to(ROOT.parent)}:{line} ({here}) imports {module} ({there})")
    assert not upward, "imports that run up (or across) a floor:\n" + "\n".join(upward)


def test_the_layering_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a cache module importing the engine is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvfence.engine.engine import LLMEngine\n")
    assert kvfence_imports(bad) == [(2, "kvfence.engine.engine")]
    assert FLOOR[unit_of("kvfence.engine.engine")] > FLOOR["cache"]


def test_trail_and_pins_load_without_torch() -> None:
    """The lowest floor is light: the audit trail, fault points, reasons and pins need no torch."""
    code = (
        "import sys, kvfence.trail.events, kvfence.trail.faults, kvfence.trail.reasons, kvfence.pins, "
        "kvfence.units; assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_test_files_have_unique_names() -> None:
    """Tests import `conftest` from their rootdir (no packages): two test files with one basename, one in
    tests/unit and one in tests/integration, stop the whole collection."""
    names = [p.name for p in (ROOT.parent / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def module_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every module under `root` (a package is its __init__.py)."""
    files = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def imported_modules(path: Path, name: str, known: set[str]) -> set[str]:
    """The other modules of `known` that module `name` (at `path`) imports anywhere: `from a.b import c`
    is a.b, and a.b.c where c is a module (a package's `from pkg import sub` is pkg.sub alone)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return (found & known) - {name}


def import_circles(root: Path) -> list[list[str]]:
    """Every circle of imports among the modules under `root`: the strongly connected components of the
    import graph with more than one module (Tarjan's algorithm)."""
    files = module_files(root)
    graph = {name: sorted(imported_modules(path, name, set(files))) for name, path in files.items()}
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(name: str) -> None:
        order[name] = low[name] = len(order)
        stack.append(name)
        for other in graph[name]:
            if other not in order:
                visit(other)
                low[name] = min(low[name], low[other])
            elif other in stack:
                low[name] = min(low[name], order[other])
        if low[name] == order[name]:
            at = stack.index(name)
            component, stack[at:] = stack[at:], []
            if len(component) > 1:
                circles.append(sorted(component))

    for name in graph:
        if name not in order:
            visit(name)
    return circles


def test_no_import_circles() -> None:
    circles = import_circles(ROOT)
    assert not circles, "modules that import each other round a circle:\n" + "\n".join(map(str, circles))


def test_the_circle_check_sees_a_circle(tmp_path: Path) -> None:
    """The checker itself: a TYPE_CHECKING import back, and a function-level one, each close a circle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import B\n")
    (pkg / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n"
    )
    (pkg / "c.py").write_text("from pkg import d\n")
    (pkg / "d.py").write_text("def f():\n    import pkg.c\n")
    (pkg / "e.py").write_text("import pkg.a\n")
    assert sorted(import_circles(pkg)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
