"""A benchmark's verdicts: a missed target must fail the script, not only read FAIL in its output.

Contract: `Verdicts.record` answers PASS or FAIL and keeps every failure; `exit_status()` is 1 once any
verdict failed (after naming the failed ones), else 0.
"""

from __future__ import annotations


class Verdicts:
    """The verdicts a script has given. A missed target must fail the script, not only read FAIL in its
    output: the script's main returns `exit_status()`, which is 1 once any verdict failed."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def record(self, name: str, passed: bool) -> str:
        """'PASS' or 'FAIL' for the check `name`; a failure is kept for the exit status."""
        if not passed:
            self.failed.append(name)
        return "PASS" if passed else "FAIL"

    def exit_status(self) -> int:
        """0 when every verdict passed; else 1, after naming the failed ones (the last line of the run)."""
        if self.failed:
            print(f"FAILED {len(self.failed)} verdict(s): {'; '.join(self.failed)}")
        return 1 if self.failed else 0
