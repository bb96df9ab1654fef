"""What pins a running engine, reported by the server itself at GET /v1/audit/info: the code (version,
git commit), the weights (file and sha256), the pool and the window, and whether the fence is on.

An auditor compares these with what it expects; it never has to trust its own copy of the model file or
guess the page size. Everything here is static after start-up, so it is safe to read from any thread.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

import kvfence
from kvfence.engine.engine import LLMEngine
from kvfence.model.gguf import file_sha256


def engine_version() -> str | None:
    try:
        return importlib.metadata.version("kvfence")
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
    commit, dirty = git_commit(Path(kvfence.__file__).parent)
    return {
        "kvfence_version": engine_version(),
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": torch.__version__,
    }


def engine_info(engine: LLMEngine) -> dict[str, Any]:
    """This engine's pins (one pool). The model sha256 is None when the engine was not loaded from a file."""
    path = engine.model_file
    return {
        **code_info(),
        "pid": os.getpid(),
        "model_file": str(path) if path else None,
        "model_sha256": file_sha256(path) if path else None,
        "dtype": str(engine.model.dtype).removeprefix("torch."),
        "device": str(engine.model.device),
        "decode_attention": engine.model.decode_attention,
        "decode_matmul": engine.model.decode_matmul,
        "page_size": engine.pool.page_size,
        "num_pages": engine.pool.num_pages,
        "capacity_tokens": engine.capacity.capacity_tokens,
        "max_model_len": engine.max_model_len,
        "isolation": engine.fence.enabled,
        "prefix_caching": engine.prefix is not None,
    }
