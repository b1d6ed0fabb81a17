"""The deduplication benchmark's --quick mode end to end: the copies inflate site 0's weight, deduplication
restores the clean weights and finds the planted copies."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_dedup_quick(tmp_path):
    result = run_quick("dedup", tmp_path, timeout_s=300)
    summary = result["summary"]["tabular"]
    clean, duplicated, deduplicated = (
        summary[c]["weights"] for c in ("clean", "duplicated", "deduplicated")
    )
    assert duplicated[0] > clean[0] + 0.05  # the copies inflate the referral site's weight
    assert deduplicated == pytest.approx(clean, abs=0.01)
    assert result["goals"]["tabular"]["met"]
    assert (tmp_path / "dedup.md").read_text().count("| deduplicated |") == 1
