"""The heterogeneous benchmark's bookkeeping, by hand, and its quick mode end to end."""

from __future__ import annotations

import pytest
from helpers import run_quick

from hydrafl.benchmarks.heterogeneous import goals, merged, method_stats, paired, summarise
from hydrafl.simulation.grid import FIRST_NODE_ID


def _round(
    accuracy: float, up: int, down: int, params: list[int], memory: list[int], number: int = 1
) -> dict:
    nodes = [str(FIRST_NODE_ID + i) for i in range(len(params))]  # tiers cycle small, medium, large
    return {
        "round": number,
        "accuracy": accuracy,
        "bytes_up": up,
        "bytes_down": down,
        "trainable_params_per_site": dict(zip(nodes, params, strict=True)),
        "peak_memory_per_site": dict(zip(nodes, memory, strict=True)),
    }


def test_a_runs_summary_and_the_goals_by_hand():
    history = [
        _round(0.1, 0, 0, [], [], 0),  # round 0: the initial evaluation, no training
        _round(0.5, 100, 300, [10, 20, 30, 10], [5, 6, 7, 9], 1),
        _round(0.7, 200, 400, [10, 20, 30, 10], [5, 6, 7, 4], 2),
    ]
    summary = summarise(history)
    assert summary == {
        "accuracy": 0.7,
        "bytes_per_round": 500,
        "params": {"small": 10, "medium": 20, "large": 30},
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
        "minilm-full": {
            "fedavg": method_stats([{**summary, "accuracy": 0.80, "bytes_per_round": 1000.0}])
        },
        "minilm-lora": {
            "hydra": method_stats([{**summary, "accuracy": 0.795, "bytes_per_round": 50.0}])
        },
    }
    assert stats["full"]["hydra"]["accuracy_mean"] == pytest.approx(0.76)
    assert stats["full"]["hydra"]["accuracy_std"] == pytest.approx(0.0141421, rel=1e-4)
    verdicts = goals(stats)
    assert verdicts["full: hydra >= best baseline (heterofl)"] is True
    assert verdicts["lora: hydra >= best baseline (flora)"] is False
    assert verdicts["bytes ratio minilm-full fedavg / minilm-lora hydra"] == pytest.approx(20.0)
    assert verdicts["accuracy points minilm-lora hydra below minilm-full fedavg"] == pytest.approx(
        0.5
    )
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
    assert (
        result["stats"]["lora"]["hydra"]["bytes_per_round"]
        < result["stats"]["full"]["fedavg"]["bytes_per_round"]
    )
    lora = result["stats"]["lora"]["flexlora"]["params"]
    assert lora["small"] < lora["medium"] <= lora["large"]  # ranks sized by tier


def _runs(accuracies: dict[int, float]) -> list[dict]:
    return [{"seed": seed, "accuracy": accuracy} for seed, accuracy in accuracies.items()]


def test_hydra_against_the_best_baseline_paired_by_seed():
    runs = {
        "lora": {
            "hydra": _runs({0: 0.70, 1: 0.80, 2: 0.76}),
            "flora": _runs({0: 0.72, 1: 0.81, 2: 0.79}),
            "hetlora": _runs({0: 0.60, 1: 0.99, 2: 0.40}),  # mean 0.663: not the best baseline
            "fedit": _runs(
                {0: 0.90, 1: 0.90, 2: 0.90}
            ),  # FedIT is FedAvg on LoRA, not a heterogeneous baseline
        }
    }
    stats = {
        "lora": {
            name: {"accuracy_mean": sum(r["accuracy"] for r in v) / len(v)}
            for name, v in runs["lora"].items()
        }
    }
    # differences -2, -1, -3 points: mean -2, sd 1, standard error 1 / sqrt(3)
    assert paired(runs, stats) == {
        "lora: hydra - flora": {
            "seeds": 3,
            "mean_points": pytest.approx(-2.0),
            "standard_error_points": pytest.approx(3**-0.5),
        }
    }
    runs["lora"]["flora"] = _runs({2: 0.79, 7: 0.5})  # one seed in common: no spread to report
    assert paired(runs, {"lora": {**stats["lora"], "flora": {"accuracy_mean": 0.9}}}) == {}


def test_runs_merge_by_seed_into_a_previous_results_file():
    scale = {"sites": 3, "rounds": 6, "local_steps": 8, "seeds": 3}
    previous = {
        "quick": False,
        "scales": {"minilm-full": scale, "minilm-lora": scale},
        "runs": {
            "minilm-full": {"fedavg": _runs({0: 0.8})},
            "minilm-lora": {"hydra": _runs({0: 0.1, 1: 0.2, 2: 0.3}), "fedit": _runs({0: 0.4})},
        },
    }
    new = {"minilm-lora": {"hydra": _runs({2: 0.9, 3: 0.95})}}
    runs, scales = merged(previous, new, {"minilm-lora": {**scale, "seeds": 2}}, quick=False)
    assert runs["minilm-full"] == previous["runs"]["minilm-full"]  # a group not run stays
    assert runs["minilm-lora"]["hydra"] == _runs(
        {0: 0.1, 1: 0.2, 2: 0.9, 3: 0.95}
    )  # seed 2 replaced, 3 added
    assert runs["minilm-lora"]["fedit"] == _runs({0: 0.4})
    assert scales["minilm-lora"]["seeds"] == 4
    longer = {**scale, "rounds": 12, "seeds": 2}  # another scale: the group starts afresh
    runs, scales = merged(previous, new, {"minilm-lora": longer}, quick=False)
    assert runs["minilm-lora"] == new["minilm-lora"] and scales["minilm-lora"] == {
        **longer,
        "seeds": 2,
    }
    assert merged(previous, new, {"minilm-lora": scale}, quick=True) == (
        new,
        {"minilm-lora": scale},
    )
