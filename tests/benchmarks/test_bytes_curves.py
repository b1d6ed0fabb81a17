"""The bytes benchmark's bookkeeping by hand: cumulative bytes per round, FedAvg's plateau, each method's bytes
to within a point of it."""

from __future__ import annotations

import json

import pytest

from hydrafl.benchmarks.bytes_curves import analyse, curve, recorded, simulation
from hydrafl.simulation.grid import FIRST_NODE_ID

NODES = [str(FIRST_NODE_ID + i) for i in range(3)]  # tiers small, medium, large


def _history(accuracies: list[float], up: list[int], down: list[int]) -> list[dict]:
    """Round 0 downloads and evaluates; every later round moves `up` and `down` per site."""
    return [
        {
            "round": r,
            "accuracy": accuracy,
            "bytes_up": sum(up) if r else 0,
            "bytes_down": sum(down),
            "bytes_up_per_site": dict(zip(NODES, up if r else [0, 0, 0], strict=True)),
            "bytes_down_per_site": dict(zip(NODES, down, strict=True)),
        }
        for r, accuracy in enumerate(accuracies)
    ]


def test_a_runs_curve_accumulates_bytes_and_averages_each_tiers_per_round():
    run = curve(_history([0.1, 0.5, 0.6], up=[1, 2, 3], down=[10, 10, 10]))
    assert run["accuracy"] == [0.1, 0.5, 0.6]
    assert run["bytes"] == [30, 66, 102]  # 30 down, then 6 up + 30 down a round
    assert run["bytes_up_per_tier"] == {"small": 1, "medium": 2, "large": 3}
    assert run["bytes_down_per_tier"] == {"small": 10, "medium": 10, "large": 10}


FEDAVG = [
    0.2,
    0.80,
    0.81,
    0.81,
    0.81,
    0.82,
    0.81,
]  # last 3 rounds 0.8133, the 3 before 0.81: plateaued


def _runs(hydra: list[float]) -> dict[str, list[dict]]:
    full = [
        {"seed": seed, **curve(_history([a + shift for a in FEDAVG], [100] * 3, [200] * 3))}
        for seed, shift in enumerate((0.01, -0.01))
    ]
    lora = [{"seed": 0, **curve(_history(hydra, [1, 2, 3], [2, 2, 2]))}]
    return {"fedavg (full model)": full, "hydra (LoRA)": lora}


def test_the_plateau_and_each_methods_bytes_to_within_a_point_of_it_by_hand():
    summary = analyse(_runs([0.2, 0.5, 0.7, 0.79, 0.805, 0.81, 0.81]))
    assert summary["plateau"] == pytest.approx((0.81 + 0.82 + 0.81) / 3)
    assert summary["plateaued"] is True
    fedavg, hydra = summary["methods"]["fedavg (full model)"], summary["methods"]["hydra (LoRA)"]
    assert fedavg["accuracy_std"][1] == pytest.approx(0.02**0.5 / 10)  # 0.81 and 0.79
    # target 0.8033: FedAvg's mean first reaches it in round 2 (600 down, then 900 a round), Hydra in round 4
    assert fedavg["bytes_mean"][:3] == [600, 1500, 2400] and fedavg["bytes_to_plateau"] == 2400
    assert hydra["bytes_to_plateau"] == 6 + 4 * 12 and hydra["bytes_per_round"] == 12
    assert hydra["bytes_ratio"] == pytest.approx(2400 / 54)
    assert hydra["accuracy_at_tenth_bytes"] == 0.81  # the whole run fits in 240 bytes
    assert hydra["points_below_plateau"] == pytest.approx(100 * (0.81333333 - 0.80833333))
    assert summary["goal_met"] is True


def test_a_method_that_never_gets_within_a_point_has_no_ratio_and_misses_the_goal():
    summary = analyse(_runs([0.2, 0.5, 0.7, 0.79, 0.80, 0.78, 0.79]))
    hydra = summary["methods"]["hydra (LoRA)"]
    assert hydra["bytes_to_plateau"] is None and hydra["bytes_ratio"] is None
    assert hydra["points_below_plateau"] == pytest.approx(100 * (0.81333333 - 0.79))
    assert summary["goal_met"] is False


def test_no_goal_is_met_against_a_reference_still_climbing():
    runs = _runs([0.2, 0.5, 0.7, 0.79, 0.805, 0.81, 0.81])
    climbing = [
        0.2,
        0.70,
        0.80,
        0.81,
        0.80,
        0.815,
        0.825,
    ]  # last 3 rounds 0.8133, the 3 before 0.77
    for run in runs["fedavg (full model)"]:
        run["accuracy"] = climbing
    summary = analyse(runs)
    assert summary["plateaued"] is False and summary["goal_met"] is False
    assert summary["methods"]["hydra (LoRA)"]["bytes_ratio"] == pytest.approx(3300 / 54)


def test_one_lucky_round_within_a_point_is_not_the_goal():
    summary = analyse(_runs([0.2, 0.5, 0.7, 0.79, 0.81, 0.78, 0.79]))
    hydra = summary["methods"]["hydra (LoRA)"]
    assert hydra["bytes_ratio"] == pytest.approx(2400 / 54)  # round 4 got there once
    assert hydra["points_below_plateau"] == pytest.approx(100 * (0.81333333 - 0.79333333))
    assert summary["goal_met"] is False


def test_a_run_already_in_the_work_folder_gives_its_first_rounds(tmp_path):
    config = simulation("minilm-lora", "hydra", 1, False, 3, tmp_path)
    stored = {**config.run_config("hydra").to_flower(), "rounds": 12, "resume": True}
    folder = tmp_path / "minilm-lora-hydra-seed1" / "hydra"
    folder.mkdir(parents=True)
    history = [{"round": r} for r in range(5)]  # still running: 4 of its 12 rounds done
    (folder / "checkpoint.json").write_text(json.dumps({"run_config": stored, "history": history}))
    assert recorded(config, 3) == history[:4]
    assert recorded(simulation("minilm-lora", "hydra", 1, False, 5, tmp_path), 5) is None
    other = simulation("minilm-lora", "hydra", 2, False, 3, tmp_path)  # seed 2: another folder
    assert recorded(other, 3) is None
    (folder / "checkpoint.json").write_text(
        json.dumps({"run_config": {**stored, "lr": 1.0}, "history": history})
    )
    assert recorded(config, 3) is None  # another configuration in the folder
