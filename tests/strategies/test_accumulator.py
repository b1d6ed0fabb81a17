"""The streaming accumulator equals the batch weighted mean, and refuses replies it cannot combine."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import make_reply

from hydrafl.strategies import AggregationError, MaskedDeltaAccumulator, WeightedDeltaAccumulator
from hydrafl.subnet.slices import Slice


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


def test_compact_slices_fold_into_the_masked_mean_by_hand():
    """Site A (weight 2) trained columns 0-1 of a 2x3 tensor, site B (weight 1) columns 1-2; each sent only
    its columns. Column 0 is A's delta, column 2 is B's, column 1 is (2 A + 1 B) / 3; `bias` nobody trained."""
    shapes = {"w": (2, 3), "bias": (3,)}
    accumulator = MaskedDeltaAccumulator()
    a = make_reply({"w": np.array([[1, 2], [3, 4]], dtype=np.float32)}, num_examples=2, node_id=1)
    b = make_reply({"w": np.array([[10, 20], [30, 40]], dtype=np.float32)}, num_examples=1, node_id=2)
    accumulator.add_slices(a, {"w": Slice(1, (0, 1))}, shapes)
    accumulator.add_slices(b, {"w": Slice(1, (1, 2)), "bias": Slice(None)}, shapes)
    mean = accumulator.mean()
    assert set(mean) == {"w"}
    delta, trained = mean["w"]
    np.testing.assert_allclose(delta.numpy(), [[1, 14 / 3, 20], [3, 38 / 3, 40]], rtol=1e-6)
    assert trained.all()


def test_compact_slices_count_once_and_refuse_a_wrong_slice_shape():
    shapes = {"w": (2, 3)}
    accumulator = MaskedDeltaAccumulator()
    a = make_reply({"w": np.full((2, 1), 3.0, dtype=np.float32)}, num_examples=5, node_id=1)
    b = make_reply({"w": np.full((2, 1), 6.0, dtype=np.float32)}, num_examples=1, node_id=2)
    accumulator.add_slices(a, {"w": Slice(1, (2,))}, shapes, count_once=True)
    accumulator.add_slices(b, {"w": Slice(1, (2,))}, shapes, count_once=True)
    with pytest.raises(AggregationError, match=r"has shape \(2, 1\), its slice is \(2, 2\)"):
        accumulator.add_slices(b, {"w": Slice(1, (0, 2))}, shapes)
    with pytest.raises(AggregationError, match="outside its subnetwork"):
        accumulator.add_slices(b, {}, shapes)
    delta, trained = accumulator.mean()["w"]
    np.testing.assert_allclose(delta.numpy(), [[0, 0, 4.5], [0, 0, 4.5]])  # plain mean of 3 and 6
    assert trained.tolist() == [[False, False, True], [False, False, True]]
