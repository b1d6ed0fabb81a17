"""One secure-aggregation round end to end over the two state machines: the coordinator learns the sum, within
the quantisation bound, and nothing it holds for one site looks like that site's update."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from secagg_rounds import secure_sum, updates

from hydrafl.secagg import SecAggError, SecAggParams, quantisation_bound

NODES = [1001, 1002, 1003, 1004, 1005]


def plain(data, nodes):
    return sum(data[n][1] for n in nodes), sum(data[n][1] * data[n][0] for n in nodes)


@pytest.mark.parametrize("num_shares", [0, 3])
def test_secure_sum_equals_plain_sum_within_the_quantisation_bound(num_shares):
    params = SecAggParams(num_shares=num_shares)
    data = updates(NODES, 2000)
    weights, total = secure_sum(data, params)
    plain_weight, plain_total = plain(data, NODES)
    assert weights.tolist() == [plain_weight]
    error = np.abs(total - plain_total).max()
    assert error <= quantisation_bound(5, params)
    assert error > 0  # it was quantised: the bound is not vacuous


def test_quantisation_is_unbiased_so_the_mean_error_shrinks():
    params = SecAggParams()
    data = updates(NODES, 50_000)
    _, total = secure_sum(data, params)
    bias = np.mean(total - plain(data, NODES)[1])
    assert abs(bias) < quantisation_bound(5, params) / 50


def test_a_masked_vector_is_uniform_over_the_field_and_differs_from_the_update():
    data = updates(NODES, 100_000)
    seen = {}
    secure_sum(data, SecAggParams(), seen=seen)
    masked = seen[NODES[0]]
    observed = np.bincount(masked >> 28, minlength=16)  # the field's 4 high bits
    assert stats.chisquare(observed).pvalue > 1e-3
    from hydrafl.secagg import encode

    encoded = encode(data[NODES[0]][0], data[NODES[0]][1], SecAggParams(), np.random.default_rng(0))
    assert (
        stats.chisquare(np.bincount(encoded >> 28, minlength=16)).pvalue < 1e-12
    )  # the plain encoding is not
    assert np.mean(masked == encoded) < 1e-3
    assert abs(np.corrcoef(masked[1:].astype(float), data[NODES[0]][0])[0, 1]) < 0.02


def test_a_site_dropping_before_its_upload_is_recovered_exactly():
    data = updates(NODES, 3000)
    weights, total = secure_sum(data, SecAggParams(), drop_before_upload=(1003,))
    survivors = [n for n in NODES if n != 1003]
    plain_weight, plain_total = plain(data, survivors)
    assert weights.tolist() == [plain_weight]
    assert np.abs(total - plain_total).max() <= quantisation_bound(4, SecAggParams())


def test_a_ring_of_neighbours_recovers_a_dropped_site():
    nodes = list(range(1, 8))
    params = SecAggParams(num_shares=3, reconstruction_threshold=2)
    data = updates(nodes, 500)
    weights, total = secure_sum(data, params, drop_before_upload=(4,))
    survivors = [n for n in nodes if n != 4]
    assert weights.tolist() == [plain(data, survivors)[0]]
    assert np.abs(total - plain(data, survivors)[1]).max() <= quantisation_bound(6, params)


def test_a_survivor_silent_while_unmasking_still_counts():
    data = updates(NODES, 1000)
    weights, total = secure_sum(data, SecAggParams(), silent_in_unmask=(1005,))
    assert weights.tolist() == [plain(data, NODES)[0]]
    assert np.abs(total - plain(data, NODES)[1]).max() <= quantisation_bound(5, SecAggParams())


def test_fewer_survivors_than_the_threshold_halt_the_round():
    data = updates(NODES, 100)
    with pytest.raises(
        SecAggError, match="only 2 of 5 sites sent masked vectors.*threshold is 3.*halts"
    ):
        secure_sum(data, SecAggParams(), drop_before_upload=(1001, 1002, 1003))


def test_too_few_unmasking_shares_halt_the_round():
    data = updates(NODES, 100)
    with pytest.raises(SecAggError, match="shares of site .* needed; the round halts"):
        secure_sum(data, SecAggParams(), silent_in_unmask=(1001, 1002, 1003))
