"""Each site pulls the weights towards its own target, set by its partition id."""

import numpy as np

DIM = 4


def target(partition_id: int) -> np.ndarray:
    return np.arange(DIM, dtype=np.float32) * (partition_id + 1)


def loss(weights: np.ndarray, partition_id: int) -> float:
    return float(np.mean((weights - target(partition_id)) ** 2))
