"""The benchmarks' --quick modes run end to end and their numerical checks pass; the one timing asserted is a
ratio of several seconds (the command line against the imports it does not make); aggregation's throughput
ratios are only checked to be there (its goals are judged on the full run)."""

from __future__ import annotations

import statistics

import pytest
from helpers import run_quick


@pytest.mark.slow
def test_aggregation_quick(tmp_path):
    result = run_quick("aggregation", tmp_path, timeout_s=300)
    assert result["quick"] is True
    names = {
        "torch adds",
        "torch masked adds",
        "hydrafl",
        "hydrafl one by one",
        "hydrafl masked",
        "flower",
    }
    assert set(result["throughput"]) == {"1 thread", "2 threads", "2 threads, other core busy"}
    for setting in result["throughput"].values():
        assert set(setting["median_s"]) == set(setting["gb_per_s"]) == names
        assert set(setting["ratio_vs_baseline"]) == names - {"torch adds", "torch masked adds"}
        assert all(
            ratio > 0 for ratio in setting["ratio_vs_baseline"].values()
        )  # goals: the full run's
        assert set(setting["goal_met"]) == {"hydrafl", "hydrafl masked"}
    equality = result["equality"]
    assert equality["passed"], (
        equality
    )  # within 1e-5 of float64 references, bitwise across threads and grouping
    assert all(equality["bit_identical"].values())
    memory = result["memory"]
    assert memory["baseline_mb"] > 0 and memory["model_mb"] > 0
    assert [int(count) for count in memory["sites"]] == [2, 4]
    for entry in memory["sites"].values():
        assert set(entry) == {"hydrafl", "hydrafl masked", "flower"}
        assert all(
            {"peak_mb", "extra_mb", "extra_models"} <= set(probe) for probe in entry.values()
        )
    assert set(memory["goal_met"]) == {"hydrafl", "hydrafl masked"}


@pytest.mark.slow
def test_cli_startup_quick(tmp_path):
    result = run_quick("cli_startup", tmp_path, timeout_s=300)
    assert result["quick"] is True
    commands = result["commands"]
    assert set(commands) == {
        "hydrafl --help",
        "hydrafl admin site list",
        "baseline: import torch, flwr, matplotlib",
        "python -c pass",
    }
    assert all(len(entry["seconds"]) == result["reps"] for entry in commands.values())
    assert result["help_faster_than_baseline"], commands


@pytest.mark.slow
@pytest.mark.ray
def test_simulation_runtime_quick(tmp_path):
    pytest.importorskip("ray")
    result = run_quick("simulation_runtime", tmp_path, timeout_s=300)
    assert result["quick"] is True
    assert {run["backend"] for run in result["runs"]} == {"inprocess", "ray"}
    for backend in ("inprocess", "ray"):
        median = result["median"][backend]
        assert median["wall_s"] > 0 and median["peak_rss_mb"] > 0
    assert (
        result["median"]["ray"]["peak_processes"] > 1
    )  # Ray's own processes were seen by the sampler
    assert {
        "time_ray_over_inprocess",
        "memory_ray_over_inprocess",
        "time_goal_met",
        "memory_goal_met",
    } <= set(result["ratios"])
    assert result["equality"]["passed"], result["equality"]
    assert result["equality"]["inprocess_reps_identical"]


@pytest.mark.slow
def test_round_overhead_quick(tmp_path):
    """Both runtimes run the same stock app to its end and each of its rounds is timed; the medians are those
    rounds' medians (no goal asserted: timings)."""
    result = run_quick("round_overhead", tmp_path, timeout_s=500)
    rounds = result["rounds"]
    assert result["quick"] is True and result["stock_sites"] == 2
    for key in (
        "inprocess_s",
        "grpc_s",
        "busy_inprocess_s",
        "busy_grpc_s",
        "stock_grpc_s",
        "stock_flower_s",
    ):
        assert len(result[key]) == rounds and all(seconds > 0 for seconds in result[key]), key
    assert result["median_stock_flower_s"] == pytest.approx(
        statistics.median(result["stock_flower_s"])
    )
    assert result["stock_flower_over_grpc"] == pytest.approx(
        result["median_stock_flower_s"] / result["median_stock_grpc_s"]
    )
    assert result["overhead_s"] == pytest.approx(
        result["median_grpc_s"] - result["median_inprocess_s"]
    )
    assert result["busy_overhead_s"] == pytest.approx(
        statistics.median(result["busy_grpc_s"]) - statistics.median(result["busy_inprocess_s"])
    )
