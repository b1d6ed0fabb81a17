"""The heterogeneous benchmark's bookkeeping, by hand, and its quick mode end to end."""

from __future__ import annotations

import pytest
from helpers import run_quick

from hydrafl.benchmarks.heterogeneous import goals, method_stats, summarise
from hydrafl.simulation.grid import FIRST_NODE_ID


def _round(accuracy: float, up: int, down: int, params: list[int], memory: list[int], number: int = 1) -> dict:
    nodes = [str(FIRST_NODE_ID + i) for i in range(len(params))]  # tiers cycle small, medium, large
    return {
        "round": number, "accuracy": accuracy, "bytes_up": up, "bytes_down": down,
        "trainable_params_per_site": dict(zip(nodes, params)), "peak_memory_per_site": dict(zip(nodes, memory)),
    }


def test_a_runs_summary_and_the_goals_by_hand():
    history = [
        _round(0.1, 0, 0, [], [], 0),  # round 0: the initial evaluation, no training
        _round(0.5, 100, 300, [10, 20, 30, 10], [5, 6, 7, 9], 1),
        _round(0.7, 200, 400, [10, 20, 30, 10], [5, 6, 7, 4], 2),
    ]
    summary = summarise(history)
    assert summary == {
        "accuracy": 0.7, "bytes_per_round": 500, "params": {"small": 10, "medium": 20, "large": 30},
        "peak_memory": {"small": 9, "medium": 6, "large": 7},
    }
    stats = {
        "full": {
            "fedavg": method_stats([{**summary, "accuracy": 0.80, "bytes_per_round": 1000.0}]),
            "hydra": method_stats([{**summary, "accuracy": 0.75}, {**summary, "accuracy": 0.77}]),
            "heterofl": method_stats([{**summary, "accuracy": 0.74}]),
        },
        "lora": {
            "fedit": method_stats([{**summary, "accuracy": 0.70}]),
            "hydra": method_stats([{**summary, "accuracy": 0.795, "bytes_per_round": 50.0}]),
            "flora": method_stats([{**summary, "accuracy": 0.80}]),
        },
        "minilm-full": {"fedavg": method_stats([{**summary, "accuracy": 0.80, "bytes_per_round": 1000.0}])},
        "minilm-lora": {"hydra": method_stats([{**summary, "accuracy": 0.795, "bytes_per_round": 50.0}])},
    }
    assert stats["full"]["hydra"]["accuracy_mean"] == pytest.approx(0.76)
    assert stats["full"]["hydra"]["accuracy_std"] == pytest.approx(0.0141421, rel=1e-4)
    verdicts = goals(stats)
    assert verdicts["full: hydra >= best baseline (heterofl)"] is True
    assert verdicts["lora: hydra >= best baseline (flora)"] is False
    assert verdicts["bytes ratio minilm-full fedavg / minilm-lora hydra"] == pytest.approx(20.0)
    assert verdicts["accuracy points minilm-lora hydra below minilm-full fedavg"] == pytest.approx(0.5)
    assert verdicts["minilm-lora hydra: >= 10x fewer bytes within 1 point"] is True


def test_assigned_budgets_win_over_what_sites_report():
    history = [_round(0.1, 0, 0, [], [], 0), _round(0.5, 1, 1, [99, 99, 99], [1, 2, 3], 1)]
    assigned = {"1": {str(FIRST_NODE_ID + i): n for i, n in enumerate([10, 20, 30])}}
    assert summarise(history, assigned)["params"] == {"small": 10, "medium": 20, "large": 30}


@pytest.mark.slow
def test_heterogeneous_quick(tmp_path):
    result = run_quick("heterogeneous", tmp_path, timeout_s=900)
    assert set(result["stats"]) == {"full", "lora", "minilm-full", "minilm-lora"}
    for methods in result["stats"].values():
        for stats in methods.values():
            assert 0.0 <= stats["accuracy_mean"] <= 1.0 and stats["bytes_per_round"] > 0
            assert set(stats["params"]) == {"small", "medium", "large"}
    hydra = result["stats"]["full"]["hydra"]["params"]
    assert hydra["small"] < hydra["medium"] <= hydra["large"]
    assert result["stats"]["lora"]["hydra"]["bytes_per_round"] < result["stats"]["full"]["fedavg"]["bytes_per_round"]
    lora = result["stats"]["lora"]["flexlora"]["params"]
    assert lora["small"] < lora["medium"] <= lora["large"]  # ranks sized by tier
