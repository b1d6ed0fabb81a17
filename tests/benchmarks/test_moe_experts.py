"""The expert-selection benchmark's bookkeeping by hand, and its quick mode end to end."""

from __future__ import annotations

import pytest
from helpers import run_quick

from hydrafl.benchmarks.moe_experts import METHODS, method_stats, summarise
from hydrafl.simulation.grid import FIRST_NODE_ID


def _round(number: int, accuracy: float, loss: float, up: int, down: int, memory: list[int]):
    nodes = [str(FIRST_NODE_ID + i) for i in range(len(memory))]  # tiers small, medium, large
    return {
        "round": number,
        "accuracy": accuracy,
        "loss": loss,
        "bytes_up": up,
        "bytes_down": down,
        "peak_memory_per_site": dict(zip(nodes, memory, strict=True)),
    }


def test_a_runs_summary_and_the_spread_over_seeds_by_hand():
    history = [
        _round(0, 0.01, 7.5, 0, 0, []),  # the initial evaluation: no training, not in the means
        _round(1, 0.10, 6.0, 100, 300, [5, 6, 7]),
        _round(2, 0.20, 5.0, 200, 500, [9, 6, 7]),
    ]
    run = summarise(history)
    assert run == {
        "accuracy": 0.20,
        "loss": 5.0,
        "bytes_per_round": 550,
        "bytes_up_per_round": 150,
        "peak_memory": {"small": 9, "medium": 6, "large": 7},
    }
    other = {**run, "accuracy": 0.30, "loss": 4.0, "peak_memory": {"small": 1, "medium": 8}}
    stats = method_stats([run, other])
    assert stats["accuracy_mean"] == pytest.approx(0.25)
    assert stats["accuracy_std"] == pytest.approx(0.0707106781)  # sqrt(0.005)
    assert stats["loss_mean"] == pytest.approx(4.5)
    assert stats["peak_memory"] == {"small": 9, "medium": 8, "large": 7}


@pytest.mark.slow
def test_quick_mode_runs_every_method_and_hydra_uploads_less(tmp_path):
    summary = run_quick("moe_experts", tmp_path, timeout_s=400)
    stats = summary["stats"]
    assert set(stats) == set(METHODS)
    # small and medium sites upload 2 and 4 of the 8 experts per layer; fedavg's every site all 8
    for name in ("hydra", "hydra-routed", "hydra-random"):
        assert stats[name]["bytes_up_per_round"] < stats["fedavg"]["bytes_up_per_round"]
        assert stats[name]["bytes_up_per_round"] == stats["hydra"]["bytes_up_per_round"]
    assert (tmp_path / "moe_experts.md").read_text().count("| hydra") == 3
