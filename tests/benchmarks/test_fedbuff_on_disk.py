"""The on-disk FedBuff benchmark's --quick mode end to end: a buffer's peak resident growth does not follow the
model's size or K on disk (a window of a few tensors), does in memory, and both step to the same model."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_fedbuff_on_disk_quick(tmp_path):
    result = run_quick("fedbuff_on_disk", tmp_path, timeout_s=600)
    rows = result["rows"]
    assert result["quick"] is True and [(r["size_mib"], r["k"]) for r in rows] == [
        (32, 2),
        (32, 8),
        (128, 2),
        (128, 8),
    ]
    assert all(row["equal"] is True for row in rows)
    for row in rows:  # a window of a few 4 MiB tensors, whatever the model and K
        assert row["disk_growth_mb"] <= 16 * row["tensor_mib"]
    largest = [row for row in rows if row["size_mib"] == 128]
    assert all(row["memory_growth_mb"] > 2 * row["size_mib"] for row in largest)
    assert result["goal"]["flat_ratio"] <= 1.25 and result["goal"]["met"] is True
