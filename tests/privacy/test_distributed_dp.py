"""DP without trusting the coordinator (`--secagg` with `--dp-clip` and `--dp-noise-multiplier`), end to end on the
in-process grid with the real hydrafl app: every round records the noise its survivors added (z sqrt(k / n)) and
the epsilon `accountant.distributed_epsilon` gives for it, the sites were told the epsilon of the fewest
survivors that can unmask a sum, and the strategy steps on the sites' noised mean with nothing added on top."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message
from helpers import SMALL_RUN, site_app_failing
from typer.testing import CliRunner

from hydrafl import protocol
from hydrafl.cli import app
from hydrafl.client import site_app
from hydrafl.privacy.accountant import RoundSample, distributed_epsilon, epsilon
from hydrafl.secagg import SecAggParams, quantisation_bound
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import build_strategy
from hydrafl.strategies.noised_mean import NoisedMean
from hydrafl.updates import records
from hydrafl.validation import ConfigError

PRIVATE = SMALL_RUN.replace(
    rounds=2, run_dir="", secagg=True, dp_clip=0.5, dp_noise_multiplier=1.1, min_sites=2
)


class _RecordingGrid(InProcessGrid):
    """The in-process grid, keeping the run epsilon each train message told its site."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.told: list[float] = []

    def _deliver(self, message: Message) -> Message:
        if message.metadata.message_type == "train":
            self.told += [
                c[protocol.RUN_EPSILON]
                for c in records(message.content, ConfigRecord)
                if protocol.RUN_EPSILON in c
            ]
        return super()._deliver(message)


def _run(cfg, client_app=site_app.client_app):
    grid = _RecordingGrid(client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg), grid


@pytest.mark.parametrize(
    ("strategy", "failing"), [("fedavg", None), ("diloco", None), ("fedavg", 1)]
)
def test_each_round_accounts_the_noise_its_survivors_added(strategy, failing):
    cfg = PRIVATE.replace(strategy=strategy)
    result, grid = _run(
        cfg, site_app.client_app if failing is None else site_app_failing({failing})
    )
    survivors = 3 if failing is None else 2
    effective = 1.1 * math.sqrt(survivors / 3)
    rounds = result.history[1:]
    assert [r["sites_ok"] for r in rounds] == [survivors, survivors]
    assert [r["dp_noise_multiplier"] for r in rounds] == [pytest.approx(effective, rel=1e-9)] * 2
    assert [r["dp_epsilon"] for r in rounds] == [
        pytest.approx(distributed_epsilon([effective] * n, delta=1e-5), rel=1e-9) for n in (1, 2)
    ]
    assert [r["dp_clip"] for r in rounds] == [0.5, 0.5] and [
        r["dp_epsilon_exact"] for r in rounds
    ] == [None, None]
    fewest = 1.1 * math.sqrt(
        2 / 3
    )  # the threshold of 3 sites is 2: the least noise a decoded sum can hold
    assert grid.told == [
        pytest.approx(distributed_epsilon([effective] * (n - 1) + [fewest], delta=1e-5), rel=1e-9)
        for n in (1, 2)
        for _ in range(3)
    ]


def test_the_distributed_epsilon_is_the_gaussians_at_integer_orders_and_never_amplified_by_sampling():
    """The coordinator picks each round's sites: sampling hides nothing from it, so no round is amplified."""
    spent = distributed_epsilon([1.1] * 5, delta=1e-5)
    central = epsilon(1.1, RoundSample(4, 4), delta=1e-5, repeat=5)
    assert central <= spent <= 1.01 * central  # fewer orders: a little above the central RDP bound
    assert spent > epsilon(1.1, RoundSample(2, 4), delta=1e-5, repeat=5)
    assert distributed_epsilon([1.1, 0.9], delta=1e-5) > distributed_epsilon([1.1, 1.1], delta=1e-5)
    assert (distributed_epsilon([], delta=1e-5), distributed_epsilon([1.1, 0.0], delta=1e-5)) == (
        0.0,
        math.inf,
    )


def test_hydrafl_simulate_reports_the_distributed_epsilon_of_every_round(tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            "--task",
            "tabular",
            "--sites",
            "4",
            "--samples-per-site",
            "40",
            "--rounds",
            "2",
            "--local-steps",
            "2",
            "--batch-size",
            "8",
            "--no-progress",
            "--strategies",
            "fedavg",
            "--out",
            str(tmp_path),
            "--secagg",
            "--dp-clip",
            "0.5",
            "--dp-noise-multiplier",
            "1.1",
        ],
    )
    assert result.exit_code == 0, result.output
    rounds = json.loads((tmp_path / "results.json").read_text())["strategies"]["fedavg"]["rounds"][
        1:
    ]
    assert [r["dp_noise_multiplier"] for r in rounds] == [pytest.approx(1.1, rel=1e-9)] * 2
    assert [r["dp_epsilon"] for r in rounds] == [
        pytest.approx(distributed_epsilon([1.1] * n, delta=1e-5), rel=1e-9) for n in (1, 2)
    ]


def test_the_strategy_steps_on_the_sites_noised_mean_with_no_noise_of_the_coordinators():
    """Nothing on the coordinator clips or noises, and with z = 0 the secure run is central DP's clip-and-count-once
    run up to the lattice rounding: the sites' clipping is the mechanism's, and the strategy adds nothing."""
    assert not isinstance(build_strategy(PRIVATE), NoisedMean)
    assert build_strategy(PRIVATE.replace(strategy="diloco")).central_dp is None
    assert isinstance(build_strategy(PRIVATE.replace(secagg=False)), NoisedMean)
    clip_only = SMALL_RUN.replace(rounds=1, run_dir="", dp_clip=0.02)
    central, _ = _run(clip_only)
    secure, _ = _run(clip_only.replace(secagg=True))
    bound = quantisation_bound(3, SecAggParams(max_weight=1)) / 3
    difference = max(
        float(np.abs(central.arrays[n].numpy() - secure.arrays[n].numpy()).max())
        for n in central.arrays
    )
    plain, _ = _run(clip_only.replace(dp_clip=0.0))
    moved = max(
        float(np.abs(central.arrays[n].numpy() - plain.arrays[n].numpy()).max())
        for n in central.arrays
    )
    assert difference <= bound < moved  # the clip changed the model, and both runs clipped alike


def test_what_distributed_dp_cannot_noise_is_refused():
    with pytest.raises(ConfigError, match="invalid --dp-adaptive=True: expected off with --secagg"):
        PRIVATE.replace(dp_adaptive=True)
