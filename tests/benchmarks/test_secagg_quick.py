"""The secure-aggregation benchmark's --quick mode runs end to end and its numerical checks pass."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_secagg_quick(tmp_path):
    result = run_quick("secagg", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["all_within_bound"]
    assert [(row["sites"], row["params"]) for row in result["core"]][2:] == [(3, 100_000), (5, 100_000)]
    for row in result["core"]:
        secure, plain = row["secure"], row["plain"]
        assert secure["upload_bytes"] == plain["upload_bytes"] + 4 * row["sites"]  # uint32 words, one more: the weight
        assert secure["protocol_bytes"] > row["sites"] * 64  # at least every site's two public keys
    final = result["accuracy"]["final"]
    assert abs(final["secure"]["accuracy"] - final["plain"]["accuracy"]) <= 0.05
    assert final["secure"]["secagg_bytes"] > 0 and final["plain"]["secagg_bytes"] == 0
    assert (tmp_path / "secagg.md").read_text().startswith("| sites | params |")
