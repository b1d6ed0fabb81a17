from __future__ import annotations

import numpy as np
import pytest

from hydrafl.secagg import (
    SecAggError,
    SecAggParams,
    decode_metrics,
    decode_sum,
    encode,
    encode_metrics,
    metric_bound,
)


def test_zero_encodes_exactly_and_the_range_is_clipped():
    params = SecAggParams(clipping_range=1.0, quantization_range=1 << 10, max_weight=10)
    encoded = encode(np.array([0.0, 100.0, -100.0]), 10, params, np.random.default_rng(0))
    assert encoded.tolist() == [10, 512, 1024, 0]
    weights, total = decode_sum(encoded, 1, params, per_coordinate=False)
    assert weights.tolist() == [10] and total.tolist() == [
        0.0,
        10.0,
        -10.0,
    ]  # w * clip(delta * w / W) * W / w


def test_per_coordinate_weights_sum_exactly():
    params = SecAggParams()
    rng = np.random.default_rng(0)
    a = encode(np.full(4, 0.5), np.array([3, 3, 0, 0]), params, rng)
    b = encode(np.full(4, -0.25), np.array([0, 5, 5, 0]), params, rng)
    weights, total = decode_sum(a + b, 2, params, per_coordinate=True)
    assert weights.tolist() == [3, 8, 5, 0]
    np.testing.assert_allclose(total, [1.5, 0.25, -1.25, 0.0], atol=2e-2)


@pytest.mark.parametrize(
    ("delta", "weight", "message"),
    [
        (np.array([np.nan]), 1, "NaN"),
        (np.zeros(3), 1001, "max_weight=1000"),
        (np.zeros(3), 2.5, "integers"),
        (np.zeros(3), np.ones(2), "one per coordinate"),
    ],
)
def test_bad_input_is_refused(delta, weight, message):
    with pytest.raises(SecAggError, match=message):
        encode(delta, weight, SecAggParams(), np.random.default_rng(0))


def test_parameters_that_would_wrap_the_field_are_refused():
    with pytest.raises(SecAggError, match="wrap the 2\\^32 field"):
        SecAggParams(quantization_range=1 << 30).check_round(4)
    with pytest.raises(SecAggError, match="must be odd"):
        SecAggParams(num_shares=4).check_round(7)


def test_metric_slots_decode_only_the_weighted_mean_within_the_bound_and_clip_to_their_range():
    """Two slots per metric: the reporting sites' weight and their weighted value on [0, Q]; a value outside
    [0, range] counts as its nearest end, a missing or non-finite one leaves that site out of the mean."""
    params, rng = SecAggParams(), np.random.default_rng(0)
    ranges = [64.0, 1.0]
    sites = [([0.7, 0.5], 48), ([1.3, 0.25], 200), ([100.0, None], 7), ([-2.0, float("nan")], 1000)]
    total = sum(
        encode_metrics(values, w, ranges, params, rng).astype(np.uint64) for values, w in sites
    )
    [(loss, loss_weight), (accuracy, accuracy_weight)] = decode_metrics(
        total.astype(np.uint32), ranges, params
    )
    assert (loss_weight, accuracy_weight) == (1255, 248)
    exact_loss = (0.7 * 48 + 1.3 * 200 + 64.0 * 7 + 0.0 * 1000) / 1255  # 100 clipped to 64, -2 to 0
    assert abs(loss - exact_loss) <= metric_bound(4, 64.0, params, 1255)
    assert abs(accuracy - (0.5 * 48 + 0.25 * 200) / 248) <= metric_bound(2, 1.0, params, 248)
    assert decode_metrics(np.zeros(4, dtype=np.uint32), ranges, params) == [(None, 0), (None, 0)]
    with pytest.raises(SecAggError, match="max_weight=1000"):
        encode_metrics([0.5], 1001, [1.0], params, rng)


def test_metric_slots_of_every_site_at_the_top_of_the_range_do_not_wrap():
    params = SecAggParams()
    sites = (1 << 32) // params.quantization_range - 1
    one = encode_metrics([1e9], params.max_weight, [64.0], params, np.random.default_rng(0))
    assert one.tolist() == [params.max_weight, params.quantization_range]
    [(mean, weight)] = decode_metrics(one * np.uint32(sites), [64.0], params)
    assert weight == sites * params.max_weight and mean == 64.0
