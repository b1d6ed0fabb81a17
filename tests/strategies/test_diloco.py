"""DiLoCo's outer step against its two reference points: FedAvg of end weights, and torch's SGD."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord
from helpers import FakeGrid, make_reply

from hydrafl.strategies import DiLoCo
from hydrafl.strategies.diloco import DiLoCoConfig
from hydrafl.strategies.outer import OuterOptimizer
from hydrafl.validation import ConfigError

START = {
    "w": np.array([[1.0, -2.0], [0.5, 3.0]], dtype=np.float32),
    "b": np.array([0.1, -0.4], dtype=np.float32),
}
DELTAS = [
    ({"w": np.array([[0.2, -0.1], [0.0, 0.3]]), "b": np.array([0.05, 0.0])}, 10),
    ({"w": np.array([[-0.4, 0.2], [0.1, 0.1]]), "b": np.array([-0.02, 0.1])}, 30),
    ({"w": np.array([[0.0, 0.5], [-0.3, 0.2]]), "b": np.array([0.3, -0.2])}, 60),
]


def _record(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    return ArrayRecord({k: Array(np.asarray(v, dtype=np.float32)) for k, v in arrays.items()})


def _outer_step(
    strategy: DiLoCo, arrays: dict[str, np.ndarray], deltas, server_round: int
) -> dict[str, np.ndarray]:
    """One round: `arrays` sent to nodes 1, 2, ... (`configure_train`), which reply with `deltas`."""
    grid = FakeGrid(range(1, len(deltas) + 1))
    messages = list(strategy.configure_train(server_round, _record(arrays), ConfigRecord(), grid))
    assert sorted(m.metadata.dst_node_id for m in messages) == grid.node_ids
    replies = [make_reply(delta, n, node_id=i + 1) for i, (delta, n) in enumerate(deltas)]
    new, metrics = strategy.aggregate_train(server_round, iter(replies))
    assert metrics is not None
    return {name: array.numpy() for name, array in new.items()}


def test_outer_lr_one_without_momentum_is_fedavg_of_end_weights():
    strategy = DiLoCo(DiLoCoConfig(outer_lr=1.0, outer_momentum=0.0))
    new = _outer_step(strategy, START, DELTAS, 1)
    total = sum(n for _, n in DELTAS)
    for name in START:
        end_weights = [START[name] - delta[name] for delta, _ in DELTAS]
        fedavg = sum(n * w for w, (_, n) in zip(end_weights, DELTAS, strict=True)) / total
        np.testing.assert_allclose(new[name], fedavg, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_steps_equal_torch_sgd_fed_the_averaged_pseudo_gradient(nesterov):
    lr, momentum = 0.7, 0.9
    strategy = DiLoCo(DiLoCoConfig(outer_lr=lr, outer_momentum=momentum, outer_nesterov=nesterov))
    reference = {name: torch.tensor(value, requires_grad=True) for name, value in START.items()}
    optimizer = torch.optim.SGD(reference.values(), lr=lr, momentum=momentum, nesterov=nesterov)
    arrays = {name: value.copy() for name, value in START.items()}
    total = sum(n for _, n in DELTAS)
    for server_round in (1, 2, 3):  # three steps so the momentum buffer matters
        scaled = [({k: v * server_round for k, v in delta.items()}, n) for delta, n in DELTAS]
        arrays = _outer_step(strategy, arrays, scaled, server_round)
        for name, param in reference.items():
            param.grad = torch.tensor(
                sum(n * d[name] for d, n in scaled) / total, dtype=torch.float32
            )
        optimizer.step()
        for name in START:
            np.testing.assert_allclose(
                arrays[name], reference[name].detach().numpy(), rtol=1e-5, atol=1e-6
            )


def test_momentum_state_round_trips_through_state_dict():
    first = DiLoCo(DiLoCoConfig(outer_lr=0.5, outer_momentum=0.9))
    _outer_step(first, START, DELTAS, 1)
    second = DiLoCo(DiLoCoConfig(outer_lr=0.5, outer_momentum=0.9))
    second.load_state_dict(first.state_dict())
    a = _outer_step(first, START, DELTAS, 2)
    b = _outer_step(second, START, DELTAS, 2)
    for name in START:
        np.testing.assert_array_equal(a[name], b[name])
    assert set(first.state_dict()["momentum_buffer"]) == {"w", "b"}


def test_rejects_invalid_outer_hyperparameters():
    with pytest.raises(ConfigError, match=r"--outer-momentum=1.0: expected 0 <= mu < 1"):
        DiLoCoConfig(outer_momentum=1.0)
    with pytest.raises(ValueError, match=r"lr > 0 .*, got lr=0.0"):
        DiLoCo(DiLoCoConfig(outer_lr=0.0))


def test_the_defaults_live_in_the_config_alone():
    """DiLoCo() is DiLoCo with DiLoCoConfig's defaults: the outer optimizer states none of its own."""
    outer = DiLoCo().outer
    defaults = DiLoCoConfig()
    assert (outer.lr, outer.momentum, outer.nesterov) == (
        defaults.outer_lr,
        defaults.outer_momentum,
        defaults.outer_nesterov,
    )
    with pytest.raises(TypeError):
        OuterOptimizer(lr=0.7)  # type: ignore[call-arg]
