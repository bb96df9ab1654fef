"""bench/common.py's verdicts: one that fails makes the bench script's exit status non-zero."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

COMMON = Path(__file__).resolve().parents[2] / "bench" / "common.py"


@pytest.fixture
def common(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/common.py as a new module (bench/ is not a package), so its verdicts start empty."""
    spec = importlib.util.spec_from_file_location("bench_common", COMMON)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_every_verdict_passed_exits_zero(common: ModuleType) -> None:
    assert common.verdict("fast", True, "1.2x").startswith("PASS")
    assert common.exit_status() == 0


def test_one_failed_verdict_exits_non_zero_and_is_named(
    common: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    assert common.verdict("fast", False, "0.8x (target >= 1.0x)").startswith("FAIL")
    common.verdict("fair", True, "ok")  # a later pass does not clear the failure
    assert common.exit_status() == 1
    assert capsys.readouterr().out.splitlines()[-1] == "FAILED 1 verdict(s): fast"
