"""`hydrafl simulate` with central DP reports the epsilon the accountant gives after every round, and with a
site policy every simulated site reports its own (local) epsilon."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.privacy.accountant import RoundSample, epsilon, exact_epsilon, local_epsilon

ARGS = [
    "simulate",
    "--task",
    "tabular",
    "--sites",
    "3",
    "--samples-per-site",
    "40",
    "--rounds",
    "3",
    "--local-steps",
    "2",
    "--batch-size",
    "8",
    "--no-progress",
]


def _rounds(out, strategy: str) -> list[dict]:
    return json.loads((out / "results.json").read_text())["strategies"][strategy]["rounds"]


def test_simulate_with_central_dp_reports_epsilon_and_clip_per_round(tmp_path):
    out = tmp_path / "central"
    result = CliRunner().invoke(
        app,
        [
            *ARGS,
            "--strategies",
            "fedavg,diloco",
            "--out",
            str(out),
            "--dp-noise-multiplier",
            "1.1",
            "--dp-clip",
            "0.5",
        ],
    )
    assert result.exit_code == 0, result.output
    for strategy in ("fedavg", "diloco"):
        rounds = _rounds(out, strategy)
        assert rounds[0]["dp_epsilon"] is None  # the initial evaluation releases nothing
        spent = [r["dp_epsilon"] for r in rounds[1:]]
        assert spent == [
            pytest.approx(epsilon(1.1, RoundSample(3, 3), delta=1e-5, repeat=r), rel=1e-12)
            for r in (1, 2, 3)
        ]
        exact = [r["dp_epsilon_exact"] for r in rounds[1:]]
        assert exact == [
            pytest.approx(exact_epsilon(1.1, RoundSample(3, 3), delta=1e-5, repeat=r), rel=1e-12)
            for r in (1, 2, 3)
        ]
        assert [r["dp_clip"] for r in rounds[1:]] == [0.5, 0.5, 0.5]
        assert all(r["dp_sites_available"] == 3 for r in rounds[1:])


def test_simulate_with_adaptive_clipping_moves_the_bound(tmp_path):
    out = tmp_path / "adaptive"
    result = CliRunner().invoke(
        app,
        [
            *ARGS,
            "--sites",
            "20",
            "--samples-per-site",
            "10",
            "--strategies",
            "diloco",
            "--out",
            str(out),
            "--dp-noise-multiplier",
            "0.5",
            "--dp-clip",
            "0.001",
            "--dp-adaptive",
        ],
    )
    assert result.exit_code == 0, result.output
    clips = [r["dp_clip"] for r in _rounds(out, "diloco")[1:]]
    assert (
        clips[0] == 0.001 and clips[2] > clips[1] > clips[0]
    )  # every update is far above 0.001: it grows


def test_simulate_with_a_site_policy_reports_each_sites_local_epsilon(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text("max-update-norm = 1.0\nnoise-multiplier = 3.0\n")
    out = tmp_path / "local"
    result = CliRunner().invoke(
        app, [*ARGS, "--strategies", "fedavg", "--out", str(out), "--site-policy", str(policy)]
    )
    assert result.exit_code == 0, result.output
    rounds = _rounds(out, "fedavg")
    for r, record in enumerate(rounds[1:], start=1):
        assert record["local_epsilon_per_site"] == {
            str(node): pytest.approx(local_epsilon(3.0, r, delta=1e-5), rel=1e-12)
            for node in (1001, 1002, 1003)
        }
    bad = tmp_path / "bad.toml"
    bad.write_text("max-epsilon = -1\n")
    refused = CliRunner().invoke(
        app, [*ARGS, "--strategies", "fedavg", "--out", str(out), "--site-policy", str(bad)]
    )
    assert refused.exit_code == 2 and "max-epsilon must be a positive number" in " ".join(
        refused.output.split()
    )


def test_a_resumed_run_goes_on_spending_from_where_it_stopped(tmp_path):
    from helpers import SMALL_RUN

    from hydrafl.simulation.compare import run_strategy

    cfg = SMALL_RUN.replace(
        strategy="diloco",
        sites=20,
        samples_per_site=10,
        rounds=2,
        local_steps=2,
        dp_noise_multiplier=0.5,
        dp_clip=0.01,
        dp_adaptive=True,
        run_dir=str(tmp_path / "run"),
    )
    stopped = run_strategy(cfg, "inprocess")
    resumed = run_strategy(cfg.replace(rounds=3, resume=True), "inprocess")
    assert resumed[:3] == stopped
    assert resumed[3]["dp_epsilon"] == pytest.approx(
        epsilon(0.5, RoundSample(20, 20), delta=1e-5, repeat=3), rel=1e-12
    )
    exact = exact_epsilon(0.5, RoundSample(20, 20), delta=1e-5, repeat=3)
    assert resumed[3]["dp_epsilon_exact"] == pytest.approx(exact, rel=1e-12)
    clips = [
        record["dp_clip"] for record in resumed[1:]
    ]  # every update is far above 0.01: the bound grows
    assert (
        clips[0] == 0.01 and clips[2] > clips[1] > clips[0]
    )  # round 3 goes on from the checkpoint's bound


def test_a_subnetwork_strategy_runs_with_central_dp_on_its_masked_mean():
    from helpers import TIERED_RUN

    from hydrafl.simulation.compare import run_strategy

    for strategy in ("hydra", "heterofl"):
        history = run_strategy(
            TIERED_RUN.replace(strategy=strategy, dp_noise_multiplier=1.0, dp_clip=0.5), "inprocess"
        )
        assert [r["dp_epsilon"] for r in history[1:]] == [
            pytest.approx(epsilon(1.0, RoundSample(3, 3), delta=1e-5, repeat=r), rel=1e-12)
            for r in (1, 2)
        ]
        assert all(r["sites_ok"] == 3 and r["dp_clip"] == 0.5 for r in history[1:])


def test_simulated_sites_refuse_the_round_that_would_pass_their_budget(tmp_path):
    from helpers import SMALL_RUN

    from hydrafl.client.site_policy import SitePolicy
    from hydrafl.server.aggregation.driver import RoundFailed
    from hydrafl.simulation.compare import run_strategy

    spent = [epsilon(2.0, RoundSample(3, 3), delta=1e-5, repeat=r) for r in (1, 2)]
    cfg = SMALL_RUN.replace(
        strategy="diloco", dp_noise_multiplier=2.0, dp_clip=0.5, run_dir=str(tmp_path / "run")
    )
    policy = SitePolicy(max_epsilon=(spent[0] + spent[1]) / 2)
    with pytest.raises(RoundFailed, match="round 2: only 0 of 3 sites replied"):
        run_strategy(cfg, "inprocess", policy=policy)
    history = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [r["round"] for r in history] == [0, 1] and history[1]["dp_epsilon"] == pytest.approx(
        spent[0], rel=1e-12
    )


def test_fedit_takes_central_dp_with_noise_scaled_to_the_sites_whose_rank_covers_each_component():
    import numpy as np
    from helpers import TIERED_RUN

    from hydrafl.client import site_app
    from hydrafl.lora_pairs import lora_pairs
    from hydrafl.server import server_app
    from hydrafl.simulation.grid import InProcessGrid
    from hydrafl.strategies import build_strategy

    clip = 0.05
    cfg = TIERED_RUN.replace(strategy="fedit", lora_rank=4, rounds=1, dp_clip=clip, run_dir="")

    def run(noise: float):
        run_cfg = cfg.replace(dp_noise_multiplier=noise)
        strategy = build_strategy(run_cfg)
        grid = InProcessGrid(site_app.client_app, run_cfg.sites, run_cfg.to_flower())
        result = server_app.run_federation(grid, run_cfg, strategy=strategy)
        return result.arrays, sorted(strategy.ranks.values())

    (clean, ranks), (noisy, _) = run(0.0), run(2.0)
    noise = {name: noisy[name].numpy().astype(np.float64) - clean[name].numpy() for name in clean}
    pairs = lora_pairs(clean)
    assert len(set(ranks)) > 1  # tiers: components covered by different numbers of sites
    for component in range(max(ranks)):
        covering = sum(rank > component for rank in ranks)
        values = np.concatenate(
            [
                np.concatenate([noise[p.a][component].ravel(), noise[p.b][:, component].ravel()])
                for p in pairs
            ]
        )
        assert values.std() == pytest.approx(2.0 * clip / covering, rel=0.15)
    head = [name for name in clean if all(name not in (p.a, p.b) for p in pairs)]
    head_noise = np.concatenate([noise[name].ravel() for name in head])
    assert head_noise.std() == pytest.approx(2.0 * clip / len(ranks), rel=0.15)
