"""The run's settings reach a site once per run: messages carry only their per-round keys, and the run config
is parsed and validated once per run, not once per message (`hydrafl.benchmarks.config_traffic` counts it)."""

from __future__ import annotations

import pytest

from hydrafl.benchmarks.config_traffic import RUN, measure


@pytest.mark.parametrize("strategy", ["fedavg", "hydra"])
def test_messages_carry_per_round_keys_and_the_run_config_is_validated_once(strategy):
    counted = measure(strategy)
    assert counted["messages"] >= 2 * RUN.sites  # an init query, then evaluate and train rounds
    # fedavg: server-round only; hydra adds its sites' subnetwork layout (before: every run key, 48 and 66)
    assert counted["keys_per_message"] <= (1 if strategy == "fedavg" else 5)
    assert counted["keys_per_message"] < counted["run_keys"] / 10
    # each site parses the run's settings once (before: once per message, 7 for fedavg and 9 for hydra)
    assert counted["run_validations"] == RUN.sites
    assert counted["site_parses"] == RUN.sites
