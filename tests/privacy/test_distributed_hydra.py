"""Hydra-nets under distributed DP (`--secagg --dp-clip`): each site clips its slices to C, weighs 1, and adds
its noise share on every coordinate before masking, so a coordinate n_l sites trained gets z C / n_l on the
mean, as under central DP.

The auditor's check (the model of `test_privacy_loss.py`): the coordinator's release is the survivors' encoded
sum plus their noise, linear in the noise, so for two neighbouring federations (site 0's update replaced) the
noise that makes both releases equal is shifted by the difference of their noiseless sums; that shift, in units
of the survivors' noise std, is the privacy loss, and it must be at most the accounted 2 / z_eff, with every
site and when one dropped. In-process runs check what the strategy applies: only the decoded noised sums."""

from __future__ import annotations

import math

import numpy as np
import pytest
from dp_neighbours import NEIGHBOURS, deltas, round_replies
from flwr.app import Array, ArrayRecord
from helpers import TIERED_RUN, site_app_failing

from hydrafl.client import masked_upload, site_app
from hydrafl.privacy.accountant import distributed_epsilon
from hydrafl.secagg import SecAggParams, noise
from hydrafl.secagg.noise import DistributedNoise
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import build_strategy

Z, CLIP = 1.0, 0.05
PRIVATE = TIERED_RUN.replace(
    rounds=1, run_dir="", secagg=True, dp_clip=CLIP, dp_noise_multiplier=Z, min_sites=2
)
PARAMS = SecAggParams(max_weight=1, dp_clip=CLIP, dp_noise_multiplier=Z)


def _noiseless_sum(
    strategy, arrays, updates: dict[int, dict], survivors, monkeypatch
) -> np.ndarray:
    """The survivors' encoded sum without noise (lattice steps, centred): each update expanded to full shape,
    clipped and rounded by the sites' own code (`masked_upload.expanded_windows`), the rounding seeded per
    site."""
    shapes = {name: tuple(array.shape) for name, array in arrays.items()}
    size = sum(math.prod(shape) for shape in shapes.values())
    mechanism = DistributedNoise.of(PARAMS, size, len(updates))
    monkeypatch.setattr(noise, "skellam", lambda rng, variance, count: np.zeros(count, np.int64))
    total = np.zeros(size, dtype=np.int64)
    for node in survivors:
        record = ArrayRecord({n: Array(np.ascontiguousarray(v)) for n, v in updates[node].items()})
        encoding = noise.Encoding(PARAMS, np.random.default_rng(node), None, mechanism)
        pieces = masked_upload.expanded_windows(
            record, strategy.site_slices(node), shapes, 1, encoding
        )
        encoded = np.concatenate(list(pieces))
        total += encoded[size:].astype(np.int64) - PARAMS.quantization_range // 2
    return total


@pytest.mark.parametrize("dropped", [False, True])
def test_hydras_privacy_loss_between_neighbours_is_at_most_the_accounted_mu(dropped, monkeypatch):
    cfg = PRIVATE
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    arrays = server_app.request_initial_arrays(grid, cfg)
    strategy = build_strategy(cfg)
    replies = round_replies(strategy, grid, cfg, 1, arrays)
    nodes = [reply.metadata.src_node_id for reply in replies]
    covered = {n: set(strategy.site_slices(n)) for n in nodes}
    assert (
        len({frozenset(c) for c in covered.values()}) > 1
    )  # the tiers train different subnetworks
    updates = {node: deltas(reply) for node, reply in zip(nodes, replies, strict=True)}
    survivors = nodes[:-1] if dropped else nodes
    size = sum(math.prod(arrays[n].shape) for n in arrays)
    mechanism = DistributedNoise.of(PARAMS, size, len(nodes))
    std = math.sqrt(
        mechanism.site_variance() * len(survivors)
    )  # the survivors' noise, lattice steps
    accounted = 2 / mechanism.effective_noise_multiplier(len(survivors))
    released = _noiseless_sum(strategy, arrays, updates, survivors, monkeypatch)
    losses = {}
    for neighbour, replace in NEIGHBOURS.items():
        other = dict(updates)
        other[nodes[0]] = replace(updates[nodes[0]], updates[nodes[1]])
        shift = released - _noiseless_sum(strategy, arrays, other, survivors, monkeypatch)
        losses[neighbour] = float(np.linalg.norm(shift)) / std
    assert accounted == pytest.approx(2 / (Z * math.sqrt(len(survivors) / 3)), rel=1e-6)
    assert max(losses.values()) <= accounted, losses
    assert losses["negated"] >= 0.5 * accounted, losses


def _recorded_run(cfg, client_app=site_app.client_app):
    """A run whose strategy keeps the one summed reply it was handed and the model it made from it."""
    strategy = build_strategy(cfg)
    seen = []
    summed = strategy.aggregate_summed

    def recording(server_round, replies):
        replies = list(replies)
        new, metrics = summed(server_round, iter(replies))
        seen.append((replies, strategy.current_arrays, new))
        return new, metrics

    strategy.aggregate_summed = recording
    grid = InProcessGrid(client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg, strategy=strategy), seen, strategy


def _flat(record, names) -> np.ndarray:
    return np.concatenate([record[n].numpy().astype(np.float64).ravel() for n in names])


def test_a_hydra_run_applies_only_the_sites_noised_sums_and_its_mean_has_z_c_over_n_l():
    """The same federation with z 1.1 and with z 0: the decoded sums differ by the sites' noise alone (std
    z C~ on every coordinate), the weights are the plan's coverage exactly, and the model moves by sum / n_l on
    the coordinates some site trained and not at all elsewhere. With z 0, the secure run is the central-DP
    clip-and-count-once run up to the lattice rounding."""
    noised_cfg = PRIVATE.replace(dp_clip=0.5, dp_noise_multiplier=1.1)
    result, [(replies, start, new)], strategy = _recorded_run(noised_cfg)
    _, [(clean_replies, _, _)], _ = _recorded_run(noised_cfg.replace(dp_noise_multiplier=0.0))
    [reply], [clean] = replies, clean_replies
    names = list(start)
    sums, weights = _flat(reply.content["sums"], names), _flat(reply.content["weights"], names)
    coverage = np.zeros_like(weights)
    for node in strategy.specs:
        masks = {n: sl.mask(tuple(start[n].shape)) for n, sl in strategy.site_slices(node).items()}
        coverage += np.concatenate(
            [
                masks[n].numpy().ravel() if n in masks else np.zeros(start[n].numpy().size)
                for n in names
            ]
        )
    np.testing.assert_array_equal(weights, coverage)
    assert set(np.unique(coverage)) >= {1.0, 3.0}  # coordinates of one site and of all three
    mechanism = DistributedNoise.of(PARAMS, sums.size, 3)
    bound = 0.5 + mechanism.step * math.sqrt(sums.size)
    residual = sums - _flat(clean.content["sums"], names)
    assert np.std(residual) == pytest.approx(1.1 * bound, rel=0.05)
    trained = weights > 0
    moved = _flat(start, names) - _flat(new, names)
    np.testing.assert_allclose(moved[trained], (sums / np.maximum(weights, 1))[trained], atol=1e-5)
    assert not moved[~trained].any()
    assert result.history[1]["dp_noise_multiplier"] == pytest.approx(
        DistributedNoise.of(
            SecAggParams(max_weight=1, dp_clip=0.5, dp_noise_multiplier=1.1), sums.size, 3
        ).effective_noise_multiplier(3),
        rel=1e-12,
    )
    central_cfg = noised_cfg.replace(secagg=False, dp_noise_multiplier=0.0)
    grid = InProcessGrid(site_app.client_app, 3, central_cfg.to_flower())
    central = server_app.run_federation(grid, central_cfg).arrays
    clip_only = _flat(start, names) - _flat(clean.content["sums"], names) / np.maximum(weights, 1)
    assert np.abs(clip_only - _flat(central, names)).max() < 2 * mechanism.step


def test_a_hydra_round_with_a_dropped_site_accounts_the_survivors_noise():
    cfg = PRIVATE.replace(rounds=2, dp_clip=0.5, dp_noise_multiplier=1.1)
    result, seen, _ = _recorded_run(cfg, site_app_failing({0}))
    effective = 1.1 * math.sqrt(2 / 3)
    rounds = result.history[1:]
    assert [r["sites_ok"] for r in rounds] == [2, 2] and len(seen) == 2
    assert [r["dp_noise_multiplier"] for r in rounds] == [pytest.approx(effective, rel=1e-9)] * 2
    assert [r["dp_epsilon"] for r in rounds] == [
        pytest.approx(distributed_epsilon([effective] * n, delta=1e-5), rel=1e-9) for n in (1, 2)
    ]
    assert all(np.isfinite(r["train_loss"]) for r in rounds)


@pytest.mark.parametrize("strategy", ["heterofl", "fedit"])
def test_the_width_and_rank_baselines_share_the_mechanism(strategy):
    """A width baseline's nested channels and FedIT's LoRA ranks take the same path: one accounted round whose
    model moved by the decoded sums over the sites that trained each coordinate."""
    lora = {"lora_rank": 4} if strategy == "fedit" else {}
    cfg = PRIVATE.replace(strategy=strategy, dp_clip=0.5, dp_noise_multiplier=1.1, **lora)
    result, [([reply], start, new)], _ = _recorded_run(cfg)
    names = list(reply.content["sums"])
    sums, weights = _flat(reply.content["sums"], names), _flat(reply.content["weights"], names)
    trained = weights > 0
    assert 0 < trained.sum() and set(np.unique(weights[trained])) <= {1.0, 2.0, 3.0}
    moved = _flat(start, names) - _flat(new, names)
    np.testing.assert_allclose(moved[trained], (sums / np.maximum(weights, 1))[trained], atol=1e-5)
    assert not moved[~trained].any()
    assert result.history[1]["dp_noise_multiplier"] == pytest.approx(1.1, rel=1e-9)
