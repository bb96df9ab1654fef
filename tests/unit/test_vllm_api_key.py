"""vLLM's two ways to give the API key (issue 48): `--api-key KEY` is refused at start-up in one line naming
both alternatives, never repeating the key (a command line is readable by every local user), and
$VLLM_API_KEY is one key of tenant 'default', taken out of the environment once read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvfence.cli import build_parser
from kvfence.cli_checks import load_api_keys
from kvfence.startup import StartupError


@pytest.mark.parametrize("command", [["serve"], ["router", "--workers", "127.0.0.1:1"]])
def test_api_key_on_the_command_line_is_refused_naming_both_ways(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*command, "--api-key", "sk-s3cret"])
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and len(error.strip().splitlines()) == 1
    assert "--api-keys FILE" in error and "$VLLM_API_KEY" in error and "command line" in error
    assert "sk-s3cret" not in error


def test_vllm_api_key_is_one_tenant_and_leaves_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFENCE_API_KEYS", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    assert load_api_keys(None) == {"sk-vllm": "default"}
    assert "VLLM_API_KEY" not in os.environ  # no child process inherits it
    assert load_api_keys(None) is None  # read once: auth as the first read set it, not again


def test_vllm_api_key_beside_another_source_or_with_whitespace_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("KVFENCE_API_KEYS", "key-a tenant-a")
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    with pytest.raises(StartupError, match="keep one"):
        load_api_keys(None)
    monkeypatch.delenv("KVFENCE_API_KEYS")
    monkeypatch.setenv("VLLM_API_KEY", "sk vllm")
    with pytest.raises(StartupError, match="whitespace") as info:
        load_api_keys(None)
    assert "sk vllm" not in str(info.value)
