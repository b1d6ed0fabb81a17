"""The image-model benchmark's quick mode end to end: scanned digits as an image folder (no download), two
small-CNN candidates, the table as markdown."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_image_models_quick(tmp_path):
    result = run_quick("image_models", tmp_path, timeout_s=300)
    assert result["quick"] is True and result["images"] == {"digits": 300}
    candidates = result["config"]["candidates"]
    assert len(candidates) == 2 and set(result["sets"]["digits"]) == set(candidates)
    for name, entry in result["sets"]["digits"].items():
        assert len(entry["mean_accuracy"]) == result["config"]["rounds"] + 1
        assert len(entry["finals"]) == 1 and 0 <= entry["final_mean"] <= 1
        assert result["params"][name] > 0 and entry["seconds_per_round"] > 0
    assert result["default"] in result["overall_final_mean"]
    table = (tmp_path / "image_models.md").read_text()
    assert table.count("| digits |") == 2
