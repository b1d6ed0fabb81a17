"""The large-model benchmark's quick mode end to end: a coordinator process and three site processes run one
DiLoCo round of models kept on disk (192 and 256 MiB, over the 128 MiB the benchmark's coordinator keeps
resident); each aggregated model equals DiLoCo's in-memory aggregation of the same updates, bit for bit, and the
coordinator stays under its memory goal."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_large_model_quick(tmp_path):
    result = run_quick("large_model", tmp_path, timeout_s=900)
    rows = result["rows"]
    assert [round(row["size_gib"], 4) for row in rows] == [0.1875, 0.25]
    assert [row["sites_in_turn"] for row in rows] == [False, True]
    assert all(row["equal_to_in_memory"] and row["tensors_compared"] >= 1 for row in rows)
    assert all(0 < row["coordinator_hwm_mb"] < 1536 for row in rows)
    assert all(row["aggregation_s"] > 0 and row["floor_s"] > 0 for row in rows)
    [disk] = result["disks"]
    assert all(speed > 0 for key in ("write_gib_s", "read_gib_s") for speed in disk[key])
