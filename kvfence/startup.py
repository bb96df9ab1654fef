"""What every command checks before anything runs: a bad option is one line (`StartupError`), and a secret
comes from a file, never from a command line, which every local user reads (/proc/PID/cmdline).

Contract: `read_secret_file` returns a key file's text only when it is a regular file that no group or other
user may access (ssh's rule for a private key); `one_key` takes one key from it; `SecretOnCommandLine`
refuses a retired `--NAME KEY` option, naming `--NAME-file FILE`, and `ApiKeyOnCommandLine` vLLM's
`serve --api-key KEY`, naming `--api-keys FILE` and `$VLLM_API_KEY`, both without repeating the key.
"""

from __future__ import annotations

import argparse
import os
import stat
from pathlib import Path
from typing import Any, NoReturn


class StartupError(Exception):
    """A bad start-up option; the message is one line naming the option and how to fix it."""


def reason(exc: BaseException) -> str:
    """An exception as a short phrase on one line."""
    text = (exc.strerror if isinstance(exc, OSError) else None) or str(exc) or type(exc).__name__
    return " ".join(text.split())


def read_secret_file(path: Path, option: str) -> str:
    """The text of a file that holds keys, refused (StartupError) unless it is a regular file to which no
    group or other user has any access (the rule ssh applies to a private key). The mode is read from the
    open file, so the file checked is the file read; O_NONBLOCK: a FIFO given by mistake cannot hang the
    start before it is refused."""
    source = f"{option} {path}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise StartupError(f"{source}: cannot read it ({reason(exc)})") from exc
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise StartupError(f"{source}: not a regular file; give the file that holds the key")
        if mode & 0o077:
            raise StartupError(
                f"{source}: its mode {stat.S_IMODE(mode):04o} gives other users access to the key; "
                f"chmod 600 {path}"
            )
        with os.fdopen(fd, "rb", closefd=False) as file:
            data = file.read()
    finally:
        os.close(fd)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StartupError(f"{source}: not UTF-8 text ({reason(exc)})") from exc


def one_key(text: str, source: str) -> str:
    """The one key a file holds, one trailing newline dropped. A key with whitespace left in it is refused: a
    bearer token has none (RFC 6750), so it is a mistake (a second line, a stray CR)."""
    key = text[:-1] if text.endswith("\n") else text
    if not key:
        raise StartupError(f"{source}: it holds no key; write the key on its one line")
    if any(char.isspace() for char in key):
        raise StartupError(f"{source}: the key has whitespace in it; write the key alone on one line")
    return key


class SecretOnCommandLine(argparse.Action):
    """A retired `--NAME KEY` (`--admin-key`, `kvfence audit --api-key`), refused with what replaces it,
    `--NAME-file FILE`: a command line is readable by every local user (/proc/PID/cmdline). Its value is
    never repeated."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None
    ) -> NoReturn:
        parser.error(
            f"{option_string} is refused: every local user can read a command line; write the key alone in "
            f"a file only you can read (chmod 600) and pass {option_string}-file FILE"
            + (", or set $KVFENCE_ADMIN_KEY" if option_string == "--admin-key" else "")
        )


class ApiKeyOnCommandLine(argparse.Action):
    """vLLM's `serve --api-key KEY`, refused with its two replacements (a command line is readable by every
    local user); the key is never repeated."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: str | None = None
    ) -> NoReturn:
        parser.error(
            f"{option_string} is refused: every local user can read a command line; write 'KEY TENANT' in a "
            "file only you can read (chmod 600) and pass --api-keys FILE, or set $VLLM_API_KEY (one key, "
            "tenant 'default')"
        )
