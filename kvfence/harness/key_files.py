"""Key files for the commands the harness runs: a secret is never an option's value (every local user reads
a command line), so a test or benchmark writes each key into a file only its owner may read."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def write_key_file(path: Path, lines: Sequence[str]) -> Path:
    """`lines` into `path`, created 0600 (refused by the commands otherwise)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        file.write("".join(f"{line}\n" for line in lines))
    return path


def audit_key_args(directory: Path, api_keys: Sequence[str] = (), admin_key: str | None = None) -> list[str]:
    """`kvfence audit`'s key options: the tenants' keys and the admin key, each given, as files in
    `directory`."""
    args = ["--api-key-file", str(write_key_file(directory / "audit-api-keys", api_keys))] if api_keys else []
    if admin_key is not None:
        args += ["--admin-key-file", str(write_key_file(directory / "audit-admin-key", [admin_key]))]
    return args
