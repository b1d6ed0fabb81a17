"""The privacy benchmark's table by hand, and its quick mode end to end (every strategy, on the unequal split:
the epsilon each run reports, by both accountants, is the target its noise was calibrated for)."""

from __future__ import annotations

import pytest
from helpers import run_quick

from hydrafl.benchmarks.privacy import QUICK, STRATEGIES, markdown, summarise


def test_a_runs_summary_and_its_markdown_row():
    history = [
        {"accuracy": 0.2, "dp_epsilon": None},
        {"accuracy": 0.5, "dp_epsilon": 2.0, "dp_epsilon_exact": 1.8},
        {"accuracy": 0.6, "dp_epsilon": 3.9, "dp_epsilon_exact": 3.5},
    ]
    run = summarise(4.0, 2.5, 0.8, QUICK, history, strategy="hydra", mechanism="central")
    assert run["noise_std"] == pytest.approx(2.5 * 0.8 / QUICK.sites)
    assert (run["strategy"], run["mechanism"], run["clip"]) == ("hydra", "central", 0.8)
    assert (run["epsilon"], run["accuracy"], run["epsilon_per_round"]) == (3.9, 0.6, [2.0, 3.9])
    assert (run["epsilon_exact"], run["epsilon_exact_per_round"]) == (3.5, [1.8, 3.5])
    baseline = summarise(
        None,
        0.0,
        0.8,
        QUICK,
        [{"accuracy": 0.2, "dp_epsilon": None}, {"accuracy": 0.7, "dp_epsilon": None}],
        strategy="hydra",
    )
    distributed = summarise(
        4.0,
        2.6,
        0.8,
        QUICK,
        [{"accuracy": 0.2, "dp_epsilon": None}, {"accuracy": 0.5, "dp_epsilon": 3.95}],
        strategy="hydra",
        mechanism="distributed",
    )
    table = markdown(
        {
            "scale": {
                "sites": 3,
                "samples_per_site": 30,
                "rounds": 2,
                "partition": "dirichlet:0.5",
            },
            "delta": 1e-5,
            "runs": [distributed, baseline, run],
        }
    )
    assert "90 notes dealt by dirichlet:0.5" in table and "Distributed DP has no exact" in table
    rows = [line for line in table.splitlines() if line.startswith("| hydra")]
    assert rows == [  # no DP, central, distributed, whatever order they ran in
        "| hydra | none | no DP | 0.000 | 0.800 | 0.0000 | inf | inf | 0.700 |  |",
        f"| hydra | central | 4 | 2.500 | 0.800 | {2.5 * 0.8 / 3:.4f} | 3.900 | 3.500 | 0.600 |  |",
        f"| hydra | distributed | 4 | 2.600 | 0.800 | {2.6 * 0.8 / 3:.4f} | 3.950 | n/a | 0.500 |  |",
    ]


@pytest.mark.slow
def test_privacy_quick(tmp_path):
    result = run_quick("privacy", tmp_path, timeout_s=900)
    assert result["scale"]["partition"].startswith("dirichlet:")
    runs = result["runs"]
    assert [(run["strategy"], run["mechanism"]) for run in runs] == [
        (s, m) for m in ("none", "central", "distributed") for s in STRATEGIES
    ]
    for run in runs[len(STRATEGIES) :]:
        baseline = runs[STRATEGIES.index(run["strategy"])]
        assert baseline["epsilon"] is None and baseline["noise_multiplier"] == 0.0
        assert run["epsilon"] == pytest.approx(4.0, abs=1e-3)  # calibrated by its own accountant
        assert run["epsilon_per_round"][0] < run["epsilon_per_round"][1]
        if run["mechanism"] == "central":  # every site trains every round: PLD is the tight one
            assert run["epsilon_exact"] <= run["epsilon"]
        else:  # the Skellam has no PLD bound, and its integer orders ask more noise for the target
            assert (
                run["epsilon_exact"] is None
                and run["noise_multiplier"] > runs[len(STRATEGIES)]["noise_multiplier"]
            )
        assert baseline["clip"] == run["clip"] == result["clips"][run["strategy"]] > 0
        assert 0.0 <= run["accuracy"] <= 1.0
    assert (tmp_path / "privacy.md").read_text().count("\n| ") == 1 + 3 * len(STRATEGIES)
