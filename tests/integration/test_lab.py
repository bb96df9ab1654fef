"""`kvfence lab`: the seed's four requests on the real model, single node and disaggregated; the replay
column compares B's answer with the same prompt answered alone on a clean engine."""

from __future__ import annotations

import pytest

from kvfence.audit.lab import format_table, run_lab
from kvfence.model.gguf import GGUFModel

pytestmark = pytest.mark.real_model


def test_lab_rows_match_their_expectations(smollm2: GGUFModel) -> None:
    rows = {
        (r.mode, r.case): r for r in run_lab(smollm2, ["single", "disaggregated"], progress=lambda _: None)
    }
    print(format_table(list(rows.values())))
    for mode in ("single", "disaggregated"):
        normal = rows[mode, "normal"]
        assert normal.status == "finished" and normal.requested == 3 and normal.foreign_read == 0
        assert normal.pages_read > 0 and normal.replay == "same"
        leak = rows[mode, "rejected_but_continues"]
        assert leak.status == "finished" and leak.foreign_read > 0, "the defect read no foreign page"
        assert leak.replay == "changed", "reading A's pages left B's answer as it is alone"
        for case in ("oversize_rejected", "patched_rejection"):
            refused = rows[mode, case]
            assert refused.status == "rejected" and refused.output == "400 context_length_exceeded"
            assert refused.allocated == refused.transferred == refused.steps == refused.pages_read == 0
            assert refused.pool_unchanged is True and refused.replay == "-"
    incident = rows["disaggregated", "rejected_but_continues"]
    assert incident.transferred == 1, "the placeholder transfer sends exactly one page"
    assert all(r.passed for r in rows.values())
