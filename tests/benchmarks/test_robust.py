"""The robust-aggregation benchmark's --quick mode end to end: every method's final accuracy per attack, the
goal's verdicts from those numbers, the Markdown table and the plot."""

from __future__ import annotations

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_robust_quick(tmp_path):
    result = run_quick("robust", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["seeds"] == {"tabular": 1}
    assert result["attacks"] == ["none", "scale"] and result["methods"] == ["fedavg", "fedmedian", "hydra-median"]
    summary = result["summary"]["tabular"]
    for attack in result["attacks"]:
        for method in result["methods"]:
            [accuracy] = result["accuracy"]["tabular"][attack][method]
            assert 0 <= accuracy <= 1 and summary["mean_accuracy"][attack][method] == accuracy
    goal = summary["goal"]["scale"]
    clean, attacked = summary["mean_accuracy"]["none"]["fedavg"], summary["mean_accuracy"]["scale"]["fedavg"]
    assert goal["fedavg_loss_points"] == pytest.approx(100 * (clean - attacked))
    assert goal["best_robust"] in ("fedmedian", "hydra-median")
    assert goal["met"] == (not goal["applies"] or goal["best_robust_gap_points"] <= 2.0)
    table = (tmp_path / "robust.md").read_text()
    assert "| fedavg |" in table and "| hydra-median |" in table
