"""The privacy benchmark's table by hand, and its quick mode end to end (the epsilon it reports is the target
its noise was calibrated for)."""

from __future__ import annotations

import pytest
from helpers import run_quick

from hydrafl.benchmarks.privacy import QUICK, markdown, summarise


def test_a_runs_summary_and_its_markdown_row():
    history = [{"accuracy": 0.2, "dp_epsilon": None}, {"accuracy": 0.5, "dp_epsilon": 2.0, "dp_epsilon_exact": 1.8},
               {"accuracy": 0.6, "dp_epsilon": 3.9, "dp_epsilon_exact": 3.5}]
    run = summarise(4.0, 2.5, 0.8, QUICK, history)
    assert run["noise_std"] == pytest.approx(2.5 * 0.8 / QUICK.sites)
    assert (run["epsilon"], run["accuracy"], run["epsilon_per_round"]) == (3.9, 0.6, [2.0, 3.9])
    assert (run["epsilon_exact"], run["epsilon_exact_per_round"]) == (3.5, [1.8, 3.5])
    baseline = summarise(None, 0.0, 0.8, QUICK, [{"accuracy": 0.2, "dp_epsilon": None}, {"accuracy": 0.7, "dp_epsilon": None}])
    table = markdown({"scale": {"sites": 3, "samples_per_site": 30, "rounds": 2}, "clip": 0.8, "delta": 1e-5,
                      "runs": [baseline, run]})
    assert "| no DP | 0.000 | 0.0000 | inf | inf | 0.700 |" in table
    assert f"| 4 | 2.500 | {2.5 * 0.8 / 3:.4f} | 3.900 | 3.500 | 0.600 |" in table


@pytest.mark.slow
def test_privacy_quick(tmp_path):
    result = run_quick("privacy", tmp_path, timeout_s=900)
    baseline, private = result["runs"]
    assert baseline["epsilon"] is None and baseline["noise_multiplier"] == 0.0
    assert private["epsilon"] == pytest.approx(4.0, abs=1e-3)  # calibrated for the run's rounds and sample rate
    assert private["epsilon_per_round"][0] < private["epsilon_per_round"][1]
    assert private["epsilon_exact"] <= private["epsilon"]  # every site trains every round: PLD is the tight one
    assert result["clip"] > 0 and 0.0 <= private["accuracy"] <= 1.0
    assert (tmp_path / "privacy.md").read_text().count("\n| ") == 3  # header and two runs
