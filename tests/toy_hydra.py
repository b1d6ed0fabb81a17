"""The toy Hydra model the Hydra strategy tests share: its slice layout, start weights, the two sites' planned
Hydra-nets and their deltas, and the planning round's replies that assign those nets."""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord
from helpers import make_scores_reply

from hydrafl.subnet.spec import SubnetSpec

# A toy "model": w is layer 0's q-like tensor, 4 head groups of one row each (axis 0, unit 1); v is layer 1,
# shared by its heads; o lies outside the layers.
LAYOUT = {"w": (0, 0, 1), "v": (1, -1, 1), "o": (-1, -1, 1)}
START = {
    "w": np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]], dtype=np.float32),
    "v": np.array([0.5, -0.5, 1.0], dtype=np.float32),
    "o": np.array([2.0, -2.0], dtype=np.float32),
}
# What the planning round assigns (`toy_scores`); Hydra keeps the other heads running, frozen.
SPEC_A = SubnetSpec(layers=(0,), heads=((0, 1),), freeze_heads=True)  # w rows 0-1, o
SPEC_B = SubnetSpec(
    layers=(0, 1), heads=((1, 2), (0, 1)), freeze_heads=True
)  # w rows 1-2, v (shared by its heads), o
DELTA_A = {  # sites send only their slices: A's rows 0-1 of w, and o
    "w": np.array([[0.1, 0.2], [0.4, 0.4]]),
    "o": np.array([1.0, 0.0]),
}
DELTA_B = {  # B's rows 1-2 of w, v and o
    "w": np.array([[0.8, 0.0], [0.3, -0.3]]),
    "v": np.array([0.2, 0.2, -0.4]),
    "o": np.array([-1.0, 2.0]),
}


def toy_record(arrays: dict) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()})


def toy_scores() -> dict:
    """The planning round's replies: both sites rank layer 0 first. A (node 1) is tier small: one layer of two
    and two heads of four, its best (0, 1). B (node 2) is untiered, so its budget is the strategy's untiered one
    (both layers, half the heads), and in layer 0 it scores heads 1 and 2 highest."""
    return {
        1: make_scores_reply(
            1,
            LAYOUT,
            layers=[2.0, 1.0],
            heads=[[4.0, 3.0, 2.0, 1.0]] * 2,
            tier="small",
            num_examples=10,
        ),
        2: make_scores_reply(
            2,
            LAYOUT,
            layers=[2.0, 1.0],
            heads=[[1.0, 4.0, 3.0, 0.0], [4.0, 3.0, 2.0, 1.0]],
            num_examples=30,
        ),
    }
