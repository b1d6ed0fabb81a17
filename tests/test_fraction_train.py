"""`--fraction-train`: each training round samples int(sites x fraction) sites (seeded, so the same config
gives the same sites), evaluation still asks every site, and central DP accounts for the sampling actually
used (a fixed number of sites out of the population, without replacement)."""

from __future__ import annotations

import pytest
from helpers import SMALL_RUN

from hydrafl.client.site_app import client_app
from hydrafl.privacy.accountant import RoundSample, epsilon, exact_epsilon
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.validation import ConfigError

RUN = SMALL_RUN.replace(
    strategy="fedavg", sites=10, samples_per_site=30, rounds=3, local_steps=1, fraction_train=0.3
)


def _run(cfg):
    grid = InProcessGrid(client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg).history


def test_each_round_trains_the_sampled_sites_only_and_the_same_seed_samples_the_same_sites():
    history = _run(RUN)
    trained = [sorted(record["bytes_up_per_site"]) for record in history[1:]]
    assert [len(sites) for sites in trained] == [3, 3, 3]
    assert len({tuple(sites) for sites in trained}) > 1  # a new sample each round
    assert all((r["sites_ok"], r["sites_failed"]) == (3, 0) for r in history[1:])
    assert [sorted(r["bytes_up_per_site"]) for r in _run(RUN)[1:]] == trained


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"fraction_train": 0.0}, r"invalid --fraction-train=0.0: expected a fraction in \(0, 1\]"),
        (
            {"fraction_train": 0.05},
            r"invalid --fraction-train=0.05: .*samples at least one of the 10 sites",
        ),
        (
            {"min_sites": 4},
            r"invalid --min-sites=4: expected 0..3 .*at most the sites a round samples",
        ),
    ],
)
def test_a_sample_the_run_cannot_take_is_refused_naming_the_flag(changes, message):
    with pytest.raises(ConfigError, match=message):
        RUN.replace(**changes)


def test_central_dp_accounts_for_the_sites_a_round_samples():
    history = _run(RUN.replace(dp_noise_multiplier=1.0, dp_clip=1.0, strategy="diloco"))
    assert [r["dp_sites_available"] for r in history[1:]] == [10, 10, 10]
    assert [r["dp_epsilon"] for r in history[1:]] == [
        pytest.approx(epsilon(1.0, RoundSample(3, 10), delta=1e-5, repeat=r), rel=1e-12)
        for r in (1, 2, 3)
    ]
    assert history[-1]["dp_epsilon"] < epsilon(
        1.0, RoundSample(10, 10), delta=1e-5, repeat=3
    )  # amplified by sampling
    assert history[-1][
        "dp_epsilon_exact"
    ] == pytest.approx(  # no replace-one PLD event for it: unamplified
        exact_epsilon(1.0, RoundSample(10, 10), delta=1e-5, repeat=3), rel=1e-12
    )
