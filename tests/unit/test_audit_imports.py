"""The audit tools, lab.py aside, are HTTP-only: each module loads without torch, numpy or the engine.

So an auditor can run `kvfence audit` (or import `kvfence.audit.client`) on a machine that has none of the
serving stack. Each module is imported alone in a fresh interpreter, so one that pulls torch in is named.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvfence

AUDIT = Path(kvfence.__file__).parent / "audit"
MODULES = sorted(f"kvfence.audit.{p.stem}" for p in AUDIT.glob("*.py") if p.stem not in ("__init__", "lab"))
# Top-level modules an HTTP-only audit must not load: torch, numpy, and every kvfence package that serves.
HEAVY = ("torch", "numpy", "kvfence.model", "kvfence.cache", "kvfence.request", "kvfence.engine")
HEAVY += ("kvfence.disagg", "kvfence.api")


def test_the_audit_modules_are_found() -> None:
    assert "kvfence.audit.client" in MODULES and "kvfence.audit.cli" in MODULES, MODULES
    assert "kvfence.audit.replay" in MODULES and "kvfence.audit.canaries" in MODULES, MODULES


@pytest.mark.parametrize("module", MODULES)
def test_audit_module_loads_without_torch(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"heavy = [h for h in {HEAVY!r} if any(m == h or m.startswith(h + '.') for m in sys.modules)]\n"
        f"assert not heavy, f'{module} imports {{heavy}}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
