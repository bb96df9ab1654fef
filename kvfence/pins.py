"""What pins a build: the kvfence version, the git commit it runs from, and the sha256 of a model file.

The one place both sides of an audit read these: the engine reports them (engine/info.py), the audit
compares them (audit/) and benchmarks stamp them on their results. It imports no torch, so an HTTP-only
auditor can read a version string without loading the engine.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import subprocess
from pathlib import Path
from typing import Any


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
    """The hex sha256 of a (model) file, computed once per process: what pins the weights being served."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
