"""The site-exchange benchmark's quick mode end to end: through files a site's memory grows by a window, in
memory by more than the model, and both ways send the same pseudo-gradient."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_site_exchange_quick(tmp_path):
    result = run_quick("site_exchange", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["goal_met"] and result["replies_identical"]
    rows = {(row["size_gib"], row["mode"]): row for row in result["rows"]}
    skipped = {(skip["size_gib"], "memory") for skip in result["memory_runs_skipped"]}
    assert set(rows) | skipped == {
        (size, mode) for size in (0.0625, 0.25) for mode in ("memory", "file")
    }
    for (_, mode), row in rows.items():
        if mode == "file":
            assert row["growth_mb"] < result["goal_growth_mb"]
        else:
            assert row["growth_of_model"] > 1  # the model downloaded and its update, held at once
    assert (tmp_path / "site_exchange.md").read_text().count("| file |") == 2
