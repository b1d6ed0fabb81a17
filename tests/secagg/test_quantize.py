from __future__ import annotations

import numpy as np
import pytest

from hydrafl.secagg import SecAggError, SecAggParams, decode_sum, encode


def test_zero_encodes_exactly_and_the_range_is_clipped():
    params = SecAggParams(clipping_range=1.0, quantization_range=1 << 10, max_weight=10)
    encoded = encode(np.array([0.0, 100.0, -100.0]), 10, params, np.random.default_rng(0))
    assert encoded.tolist() == [10, 512, 1024, 0]
    weights, total = decode_sum(encoded, 1, params, per_coordinate=False)
    assert weights.tolist() == [10] and total.tolist() == [0.0, 10.0, -10.0]  # w * clip(delta * w / W) * W / w


def test_per_coordinate_weights_sum_exactly():
    params = SecAggParams()
    rng = np.random.default_rng(0)
    a = encode(np.full(4, 0.5), np.array([3, 3, 0, 0]), params, rng)
    b = encode(np.full(4, -0.25), np.array([0, 5, 5, 0]), params, rng)
    weights, total = decode_sum(a + b, 2, params, per_coordinate=True)
    assert weights.tolist() == [3, 8, 5, 0]
    np.testing.assert_allclose(total, [1.5, 0.25, -1.25, 0.0], atol=2e-2)


@pytest.mark.parametrize(("delta", "weight", "message"), [
    (np.array([np.nan]), 1, "NaN"),
    (np.zeros(3), 1001, "max_weight=1000"),
    (np.zeros(3), 2.5, "integers"),
    (np.zeros(3), np.ones(2), "one per coordinate"),
])
def test_bad_input_is_refused(delta, weight, message):
    with pytest.raises(SecAggError, match=message):
        encode(delta, weight, SecAggParams(), np.random.default_rng(0))


def test_parameters_that_would_wrap_the_field_are_refused():
    with pytest.raises(SecAggError, match="wrap the 2\\^32 field"):
        SecAggParams(quantization_range=1 << 30).check_round(4)
    with pytest.raises(SecAggError, match="must be odd"):
        SecAggParams(num_shares=4).check_round(7)
