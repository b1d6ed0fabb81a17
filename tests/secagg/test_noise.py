"""Distributed DP's noise through the real protocol: each site clips, weighs 1 and adds its Skellam share before
masking; the coordinator's unmasked sum is exactly the sites' clipped, rounded updates plus their shares (nothing
of its own on top), its noise has std z C~ sqrt(k / n) for k survivors of n, and the accountant's effective
noise multiplier is z sqrt(k / n)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from secagg_rounds import checked, started

from hydrafl.secagg import SecAggError, SecAggParams, decode_sum, encode
from hydrafl.secagg.noise import DistributedNoise

NODES = [11, 12, 13, 14, 15]
SIZE = 20_000
PARAMS = SecAggParams(max_weight=1, dp_clip=1.0, dp_noise_multiplier=1.3)


def _updates(seed: int = 0) -> dict[int, np.ndarray]:
    """Updates of norm 0.5 to 3: most are clipped to 1."""
    rng = np.random.default_rng(seed)
    return {
        node: rng.normal(0.0, 1.0, SIZE) * rng.uniform(0.5, 3.0) / math.sqrt(SIZE) for node in NODES
    }


def _secure_sum(
    encoded: dict[int, np.ndarray],
    params: SecAggParams,
    survivors: list[int],
    per_coordinate: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(count, sum) the coordinator decodes when only `survivors` upload their encoded vectors."""
    server, sites = started(NODES, params, len(encoded[NODES[0]]))
    for node in survivors:
        server.receive_masked(node, sites[node].mask(encoded[node], server.shares_for(node)))
    checked(server, sites)
    kept, signatures = server.unmask_request()
    for node in signatures:
        server.receive_unmask(node, sites[node].unmask(kept, signatures))
    total, count = server.result()
    return decode_sum(total, count, params, per_coordinate=per_coordinate)


def _clipped(update: np.ndarray, clip: float) -> np.ndarray:
    return update * min(1.0, clip / float(np.linalg.norm(update)))


@pytest.mark.parametrize("survivors", [5, 3])
def test_the_secure_sums_noise_has_std_z_c_sqrt_k_over_n_and_the_mean_z_c_sqrt_k_over_n_over_k(
    survivors,
):
    noise = DistributedNoise.of(PARAMS, SIZE, len(NODES))
    updates, kept = _updates(), NODES[:survivors]
    encoded = {
        node: noise.encode(updates[node], PARAMS, np.random.default_rng(node)) for node in NODES
    }
    count, total = _secure_sum(encoded, PARAMS, kept)
    mean = total / count[0]
    residual = mean - sum(_clipped(updates[node], 1.0) for node in kept) / survivors
    expected = 1.3 * noise.bound * math.sqrt(survivors / len(NODES)) / survivors
    assert count[0] == survivors
    assert np.std(residual) == pytest.approx(expected, rel=0.02)
    assert abs(np.mean(residual)) < 4 * expected / math.sqrt(SIZE)
    assert noise.bound == pytest.approx(
        1.0, rel=1e-3
    )  # C~ = C + gamma sqrt(d): 16 / 2^22 x 141 = 0.05%
    assert noise.effective_noise_multiplier(survivors) == pytest.approx(
        1.3 * math.sqrt(survivors / 5), rel=1e-9
    )


def test_the_unmasked_sum_is_the_clipped_rounded_sum_plus_the_sites_noise_and_nothing_else():
    """A replay of each site's generator splits its encoded vector into its rounded clipped update (the same
    rounding draw, no noise) and its Skellam share; the coordinator's sum is exactly their sum."""
    noise = DistributedNoise.of(PARAMS, SIZE, len(NODES))
    updates, kept = _updates(1), NODES[1:]
    encoded = {
        node: noise.encode(updates[node], PARAMS, np.random.default_rng(node)) for node in NODES
    }
    count, total = _secure_sum(encoded, PARAMS, kept)
    rounded, shares = np.zeros(SIZE), np.zeros(SIZE)
    for node in kept:
        clean = encode(_clipped(updates[node], 1.0), 1, PARAMS, np.random.default_rng(node))
        rounded += clean[1:].astype(np.float64) - PARAMS.quantization_range / 2
        replay = np.random.default_rng(node)
        replay.random(SIZE)  # the rounding draw
        half = noise.site_variance() / 2
        shares += replay.poisson(half, SIZE) - replay.poisson(half, SIZE)
    step = 2 * PARAMS.clipping_range / PARAMS.quantization_range
    assert count[0] == len(kept)
    np.testing.assert_array_equal(total, (rounded + shares) * step)
    assert (
        np.abs(rounded * step - sum(_clipped(updates[node], 1.0) for node in kept)).max()
        < len(kept) * step
    )


LAYERS = {"all five": NODES, "two": NODES[:2], "one": NODES[4:]}
"""A Hydra-net's coverage: which sites train each of three layers of SIZE // 4 coordinates (the rest no site)."""


@pytest.mark.parametrize("dropped", [None, 11])
def test_a_subnetwork_sum_holds_the_same_noise_on_every_coordinate_and_its_mean_z_c_over_n_l(
    dropped,
):
    """Each site clips over its slices and adds its share on every coordinate: a layer covered by 1, 2 or 5
    sites holds k / n of the noise (z C~ sqrt(k / n) on the sum, that over n_l on the mean), also when one of
    the two sites covering a layer dropped; the weights decode exactly, with no noise."""
    width = SIZE // 4
    noise = DistributedNoise.of(PARAMS, SIZE, len(NODES))
    masks = {
        node: np.concatenate(
            [np.full(width, node in covering, dtype=np.int64) for covering in LAYERS.values()]
            + [np.zeros(SIZE - 3 * width, dtype=np.int64)]
        )
        for node in NODES
    }
    updates = {node: update * masks[node] for node, update in _updates(2).items()}
    encoded = {
        node: noise.encode(updates[node], PARAMS, np.random.default_rng(node), masks[node])
        for node in NODES
    }
    kept = [node for node in NODES if node != dropped]
    weights, sums = _secure_sum(encoded, PARAMS, kept, per_coordinate=True)
    np.testing.assert_array_equal(weights, sum(masks[node] for node in kept))
    residual = sums - sum(_clipped(updates[node], 1.0) for node in kept)
    on_sum = 1.3 * noise.bound * math.sqrt(len(kept) / len(NODES))
    for index, (name, covering) in enumerate(LAYERS.items()):
        layer = slice(index * width, (index + 1) * width)
        covered = len([node for node in covering if node in kept])
        assert np.std(residual[layer]) == pytest.approx(on_sum, rel=0.04), name
        mean_noise = residual[layer] / covered
        assert np.std(mean_noise) == pytest.approx(on_sum / covered, rel=0.04), name
    assert np.std(residual[3 * width :]) == pytest.approx(on_sum, rel=0.04)  # no site: discarded


def test_a_noise_that_could_wrap_the_field_is_refused_and_the_default_ranges_leave_room():
    DistributedNoise.of(PARAMS, 10**7, 100).check_range()
    with pytest.raises(SecAggError, match="could wrap the 2\\^32 field"):
        DistributedNoise.of(
            SecAggParams(max_weight=1, dp_clip=1.0, dp_noise_multiplier=500.0), 10**6, 10
        ).check_range()


def test_the_noise_parameters_are_checked():
    with pytest.raises(SecAggError, match="dp_noise_multiplier"):
        SecAggParams(dp_noise_multiplier=1.0)
    with pytest.raises(SecAggError, match="dp_clip"):
        SecAggParams(dp_clip=-1.0)
