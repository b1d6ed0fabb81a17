"""The streaming accumulator equals the batch weighted mean, and refuses replies it cannot combine."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_reply

from hydrafl.strategies import AggregationError, WeightedDeltaAccumulator


def test_streamed_mean_equals_weighted_mean():
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(7)]
    weights = [3, 1, 4, 1, 5, 9, 2]
    accumulator = WeightedDeltaAccumulator()
    accumulator.add_all(make_reply({"w": d}, n, node_id=i + 1) for i, (d, n) in enumerate(zip(deltas, weights)))
    expected = sum(n * d for d, n in zip(deltas, weights)) / sum(weights)
    np.testing.assert_allclose(accumulator.mean()["w"].numpy(), expected, rtol=1e-6)
    assert accumulator.total_weight == sum(weights)
    assert len(accumulator.metric_records) == 7


def test_shape_mismatch_and_empty_input_are_errors():
    accumulator = WeightedDeltaAccumulator()
    accumulator.add(make_reply({"w": np.zeros((2, 2))}, 1))
    with pytest.raises(AggregationError, match="shape"):
        accumulator.add(make_reply({"w": np.zeros((3, 2))}, 1, node_id=2))
    with pytest.raises(AggregationError, match="no successful reply"):
        WeightedDeltaAccumulator().mean()
    with pytest.raises(AggregationError, match="num-examples"):
        WeightedDeltaAccumulator().add(make_reply({"w": np.zeros(2)}, 0))
