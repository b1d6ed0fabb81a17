"""Zero-copy views of Flower arrays, and the delta <-> weights convention."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord

from hydrafl.arrays import array_view, keep_dtypes, weights_from_delta


@pytest.mark.parametrize(
    "values",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        np.zeros((0, 3), dtype=np.float16),
        np.array(3.5),
        np.arange(5, dtype=np.int64),
    ],
)
def test_view_equals_numpy_without_copying(values):
    array = Array(values)
    view = array_view(array)
    np.testing.assert_array_equal(view, array.numpy())
    assert view.dtype == values.dtype and not view.flags.writeable


def test_weights_from_delta_and_dtype_restoration():
    start = ArrayRecord({"w": Array(np.array([1.0, 2.0], dtype=np.float32))})
    delta = ArrayRecord({"w": Array(np.array([0.5, -1.0], dtype=np.float32))})
    np.testing.assert_array_equal(weights_from_delta(start, delta)["w"].numpy(), [0.5, 3.0])
    wide = ArrayRecord({"w": Array(np.array([0.25, 1.0], dtype=np.float64))})
    assert keep_dtypes(wide, start)["w"].dtype == "float32"
