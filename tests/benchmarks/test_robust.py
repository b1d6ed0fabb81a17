"""The robust-aggregation benchmark's --quick mode end to end: every method's final accuracy per attack, the
goal's verdicts from those numbers, the Markdown table and the plot."""

from __future__ import annotations

import json

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_robust_quick(tmp_path):
    result = run_quick("robust", tmp_path, timeout_s=600)
    assert result["quick"] is True and result["seeds"] == {"tabular": 1}
    assert result["attacks"] == ["none", "scale"] and result["methods"] == [
        "fedavg",
        "fedmedian",
        "hydra-median",
    ]
    summary = result["summary"]["tabular"]
    for attack in result["attacks"]:
        for method in result["methods"]:
            [accuracy] = result["accuracy"]["tabular"][attack][method]
            assert 0 <= accuracy <= 1 and summary["mean_accuracy"][attack][method] == accuracy
    goal = summary["goal"]["scale"]
    clean, attacked = (
        summary["mean_accuracy"]["none"]["fedavg"],
        summary["mean_accuracy"]["scale"]["fedavg"],
    )
    assert goal["fedavg_loss_points"] == pytest.approx(100 * (clean - attacked))
    assert goal["best_robust"] in ("fedmedian", "hydra-median")
    assert goal["met"] == (not goal["applies"] or goal["best_robust_gap_points"] <= 2.0)
    table = (tmp_path / "robust.md").read_text()
    assert "| fedavg |" in table and "| hydra-median |" in table


ACCURACY = {
    "clinical-text": {
        "none": {
            "fedavg": [0.50, 0.54],
            "hydra": [0.50, 0.50],
            "fedmedian": [0.50, 0.52],
            "hydra-clipped": [0.48, 0.50],
        },
        "scale": {
            "fedavg": [0.20, 0.20],
            "hydra": [0.10, 0.10],
            "fedmedian": [0.50, 0.52],
            "hydra-clipped": [0.47, 0.47],
        },
        "ipm": {
            "fedavg": [0.46, 0.46],
            "hydra": [0.40, 0.40],
            "fedmedian": [0.40, 0.40],
            "hydra-clipped": [0.44, 0.44],
        },
    }
}


def test_the_goal_takes_the_best_robust_rule_against_the_clean_fedavg_run():
    from hydrafl.benchmarks.robust import summarise

    entry = summarise(ACCURACY)["clinical-text"]
    assert entry["clean_fedavg"] == pytest.approx(0.52)
    assert entry["clean_fedavg_seed_std"] == pytest.approx(0.04 / 2**0.5)  # stdev of 0.50 and 0.54
    scale, ipm = entry["goal"]["scale"], entry["goal"]["ipm"]
    assert scale["fedavg_loss_points"] == pytest.approx(32.0) and scale["applies"]
    assert (
        scale["best_robust"] == "fedmedian"
        and scale["best_robust_gap_points"] == pytest.approx(1.0)
        and scale["met"]
    )
    assert scale["best_robust_gap_se_points"] == pytest.approx(
        100 * (0.0008 / 2 + 0.0002 / 2) ** 0.5
    )  # variances, ddof 1
    # hydra is not a robust rule: the best is hydra-clipped at 44, 8 points below; FedAvg loses 6 (goal off)
    assert ipm["best_robust"] == "hydra-clipped" and ipm["best_robust_gap_points"] == pytest.approx(
        8.0
    )
    assert not ipm["applies"] and ipm["met"]


def test_a_task_run_now_keeps_another_tasks_earlier_entry_with_its_own_methods(tmp_path):
    from hydrafl.benchmarks.robust import _earlier, markdown, summarise

    tabular = {a: {"fedavg": [0.7], "krum": [0.6]} for a in ("none", "scale", "ipm")}
    earlier = {
        "quick": False,
        "attacks": ["none", "scale", "ipm"],
        "accuracy": {"tabular": tabular},
        "scale": {"tabular": {"rounds": 6}},
    }
    (tmp_path / "robust.json").write_text(json.dumps(earlier))
    assert _earlier(tmp_path / "robust.json", True, ["none", "scale", "ipm"]) == (
        {},
        {},
    )  # another mode
    accuracy, scales = _earlier(tmp_path / "robust.json", False, ["none", "scale", "ipm"])
    accuracy, scales = {**accuracy, **ACCURACY}, {**scales, "clinical-text": {"rounds": 10}}
    methods = ["fedavg", "hydra", "fedmedian", "krum", "hydra-clipped"]
    text = markdown(
        summarise(accuracy),
        methods,
        ["none", "scale", "ipm"],
        scales,
        {"tabular": 1, "clinical-text": 2},
    )
    tabular_part, clinical_part = text.split("### clinical-text")
    assert "| krum | 60.0 | 60.0 | 60.0 |" in tabular_part and "hydra-clipped" not in tabular_part
    assert "rounds 10; 2 seeds; clean FedAvg 52.0 (std over seeds 2.8 points)" in clinical_part
    assert "| hydra-clipped | 49.0 | 47.0 | 44.0 |" in clinical_part and "krum" not in clinical_part
    assert (
        "- scale: FedAvg -32.0 points against its clean run; best robust fedmedian -1.0 (standard error 2.2): goal met"
        in clinical_part
    )
