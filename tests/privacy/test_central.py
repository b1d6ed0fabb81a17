"""Central DP on hydrafl's accumulators: every reply clipped to C and counted once, noise of std z C / n_k on
coordinate k's mean; adaptive clipping moves C towards the target quantile; Flower's strategies get Flower's
strategies run behind NoisedMean; the bound survives a checkpoint."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.serverapp.strategy import FedAdam, FedAvg
from flwr.supercore.differential_privacy import compute_adaptive_noise_params
from helpers import make_reply

from hydrafl.config import RunConfig
from hydrafl.privacy.adaptive import AdaptiveClip, model_noise_multiplier
from hydrafl.privacy.central import CentralDp, round_clip
from hydrafl.privacy.clipping import clip, l2_norm, noise_generator
from hydrafl.strategies import MaskedDeltaAccumulator, WeightedDeltaAccumulator, build_strategy
from hydrafl.strategies.hooks import restore_strategy_state, strategy_state
from hydrafl.strategies.noised_mean import NoisedMean
from hydrafl.subnet.slices import Slice
from hydrafl.validation import ConfigError

N = 200_000


def test_clipping_bounds_every_update_and_leaves_small_ones_alone():
    generator = torch.Generator().manual_seed(3)
    for scale in (1e-3, 0.5, 3.0, 1e4):
        update = {
            "w": torch.randn(40, 7, generator=generator) * scale,
            "b": torch.randn(7, generator=generator) * scale,
        }
        clipped = clip(update, 2.0)
        norm = l2_norm(update)
        assert l2_norm(clipped) <= 2.0 * (1 + 1e-6)
        if norm <= 2.0:
            assert all(torch.equal(clipped[k], update[k]) for k in update)
        else:
            assert l2_norm(clipped) == pytest.approx(2.0, rel=1e-6)


def test_each_reply_is_clipped_and_counted_once_whatever_its_sample_count():
    accumulator = WeightedDeltaAccumulator(dp=CentralDp(0.0, 1.0, seed=0))
    accumulator.add(
        make_reply({"w": np.array([6.0, 8.0])}, num_examples=1000, node_id=1)
    )  # norm 10 -> 1
    accumulator.add(
        make_reply({"w": np.array([0.3, 0.4])}, num_examples=1, node_id=2)
    )  # norm 0.5, kept
    mean = accumulator.mean()["w"]
    assert mean.tolist() == pytest.approx([(0.6 + 0.3) / 2, (0.8 + 0.4) / 2], rel=1e-6)
    assert accumulator.total_weight == 2.0


def test_the_mean_gets_noise_of_std_z_c_over_the_sites():
    dp = CentralDp(1.5, 2.0, seed=7)
    accumulator = WeightedDeltaAccumulator(dp=dp)
    for node in range(1, 5):
        accumulator.add(make_reply({"w": np.zeros(N)}, num_examples=10 * node, node_id=node))
    noise = accumulator.mean()["w"].double()
    assert float(noise.mean()) == pytest.approx(0.0, abs=0.01)
    assert float(noise.std()) == pytest.approx(1.5 * 2.0 / 4, rel=0.01)


def test_masked_coordinates_get_noise_for_the_sites_that_trained_them():
    shapes = {"w": (3, N)}
    accumulator = MaskedDeltaAccumulator(dp=CentralDp(1.0, 3.0, seed=11))
    for node in (1, 2, 3):  # three sites train row 0 only
        accumulator.add_slices(
            make_reply({"w": np.zeros((1, N))}, 5, node), {"w": Slice(0, (0,))}, shapes
        )
    accumulator.add_slices(
        make_reply({"w": np.zeros((2, N))}, 5, 4), {"w": Slice(0, (0, 1))}, shapes
    )  # rows 0, 1
    noise, trained = accumulator.mean()["w"]
    assert trained[:, 0].tolist() == [True, True, False]
    assert float(noise[0].std()) == pytest.approx(3.0 / 4, rel=0.01)  # n_k = 4
    assert float(noise[1].std()) == pytest.approx(3.0 / 1, rel=0.01)  # n_k = 1
    assert float(noise[2].abs().max()) == 0.0  # no site trained it: no release, no noise


def test_a_fixed_seed_repeats_the_noise_and_no_seed_does_not():
    def noise(seed):
        accumulator = WeightedDeltaAccumulator(dp=CentralDp(1.0, 1.0, seed=seed))
        accumulator.add(make_reply({"w": np.zeros(64)}, 1))
        return accumulator.mean()["w"]

    assert torch.equal(noise(5), noise(5))
    assert not torch.equal(noise(None), noise(None))


def test_adaptive_clip_moves_geometrically_towards_the_quantile():
    adaptive = AdaptiveClip(clip=1.0, count_stddev=0.0, target_quantile=0.5, lr=0.2)
    generator = noise_generator(0)
    for _ in range(
        3
    ):  # every norm above the bound: the clipped fraction is 0, the bound grows by e^{0.1}
        for norm in (5.0, 6.0, 7.0):
            adaptive.observe(norm)
        adaptive.end_round(generator)
    assert adaptive.clip == pytest.approx(math.exp(0.3), rel=1e-12)
    norms = np.random.default_rng(0).lognormal(mean=0.0, sigma=0.5, size=(300, 20))
    noisy = AdaptiveClip(clip=0.05, count_stddev=1.0)
    for row in norms:
        for norm in row:
            noisy.observe(float(norm))
        noisy.end_round(generator)
    assert noisy.clip == pytest.approx(1.0, rel=0.25)  # the median of lognormal(0, .5) is 1


def test_the_model_noise_multiplier_leaves_the_budget_of_z_as_flower_computes_it():
    assert model_noise_multiplier(0.5, 1.0) == pytest.approx(
        compute_adaptive_noise_params(0.5, 20, 1.0)[1]
    )
    assert model_noise_multiplier(0.5, 1.0) == pytest.approx((0.5**-2 - 2.0**-2) ** -0.5)
    with pytest.raises(ValueError, match="needs z < 2 sigma_b"):
        model_noise_multiplier(2.0, 1.0)


def test_hydrafl_strategies_hold_central_dp_and_its_adaptive_bound_survives_a_checkpoint():
    run = RunConfig.build(
        strategy="diloco", sites=20, dp_noise_multiplier=0.5, dp_clip=1.0, dp_adaptive=True
    )
    strategy = build_strategy(run)
    assert round_clip(strategy) == 1.0
    assert strategy.central_dp.adaptive.count_stddev == 1.0  # 20 sites / 20
    accumulator = WeightedDeltaAccumulator(dp=strategy.central_dp)
    accumulator.add(make_reply({"w": np.full(4, 10.0)}, 1))
    accumulator.mean()
    assert round_clip(strategy) != 1.0  # moved (by a noised count)
    resumed = build_strategy(run)
    restore_strategy_state(resumed, strategy_state(strategy))
    assert round_clip(resumed) == round_clip(strategy) == resumed.central_dp.adaptive.clip


def test_flower_strategies_run_behind_the_noised_mean_and_keep_their_state_through_a_checkpoint():
    fixed = build_strategy(
        RunConfig.build(strategy="fedavg", sites=5, dp_noise_multiplier=1.0, dp_clip=0.5)
    )
    assert isinstance(fixed, NoisedMean) and type(fixed.strategy) is FedAvg
    assert (fixed.central_dp.noise_multiplier, round_clip(fixed)) == (1.0, 0.5)
    run = RunConfig.build(
        strategy="fedadam", sites=4, dp_noise_multiplier=1.1, dp_clip=0.5, dp_adaptive=True
    )
    adaptive = build_strategy(
        run
    )  # README's example at the default sites: the count noise is raised to z
    assert (
        isinstance(adaptive.strategy, FedAdam) and adaptive.central_dp.adaptive.count_stddev == 1.1
    )
    adaptive.central_dp.clip, adaptive.strategy.m_t = 0.8, {"w": np.ones(3)}
    resumed = build_strategy(run)
    restore_strategy_state(resumed, strategy_state(adaptive))
    assert round_clip(resumed) == 0.8 == resumed.central_dp.adaptive.clip
    assert resumed.strategy.m_t["w"].tolist() == [1.0, 1.0, 1.0]


def test_an_all_zero_update_and_one_at_the_float32_limit_never_crash_a_round():
    accumulator = WeightedDeltaAccumulator(dp=CentralDp(0.0, 1.0, seed=0))
    accumulator.add(make_reply({"w": np.zeros(2)}, 10, node_id=1))
    accumulator.add(
        make_reply({"w": np.full(2, 3e38)}, 10, node_id=2)
    )  # its norm overflows float32: clipped to C
    accumulator.add(make_reply({"w": np.array([0.3, 0.4])}, 10, node_id=3))
    half = math.sqrt(0.5)
    assert accumulator.mean()["w"].tolist() == pytest.approx(
        [(half + 0.3) / 3, (half + 0.4) / 3], rel=1e-6
    )
    assert accumulator.total_weight == 3.0


def test_runs_central_dp_cannot_serve_say_so():
    for strategy in (
        "flora",
        "hetlora",
        "flexlora",
    ):  # folds that are not linear in one site's update
        with pytest.raises(
            ConfigError, match=f"0 for strategy '{strategy}': its output is not a post-processing"
        ):
            RunConfig.build(strategy=strategy, lora_rank=4, dp_noise_multiplier=1.0, dp_clip=0.5)
    with pytest.raises(ConfigError, match="LoRA products"):
        build_strategy(
            RunConfig.build(strategy="hydra", lora_rank=4, dp_noise_multiplier=1.0, dp_clip=0.5)
        )
