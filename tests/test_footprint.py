"""The training footprint counts what a step really holds: hand-checked on a two-layer MLP."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from torch import nn

from hydrafl.footprint import training_footprint


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def test_footprint_of_a_small_mlp_matches_a_hand_count():
    model, x, y = _mlp(), torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])
    footprint = training_footprint(model, lambda: F.cross_entropy(model(x), y), "adamw")
    params = (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert footprint.parameter_bytes == params
    assert footprint.gradient_bytes == params and footprint.optimizer_bytes == 2 * params
    # saved for backward: the input x (first linear), the ReLU output (5x16: one storage, saved by ReLU and by
    # the second linear), the log-softmax (5x4) and the targets (5 int64), plus at most a few scalars
    hand_count = 5 * 8 * 4 + 5 * 16 * 4 + 5 * 4 * 4 + 5 * 8
    assert hand_count <= footprint.activation_bytes <= hand_count + 16


def test_freezing_the_first_layer_drops_its_gradients_state_and_saved_input():
    model, x, y = _mlp(), torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])
    full = training_footprint(model, lambda: F.cross_entropy(model(x), y), "sgd")
    model[0].requires_grad_(False)
    frozen = training_footprint(model, lambda: F.cross_entropy(model(x), y), "sgd")
    first_layer = (8 * 16 + 16) * 4
    assert frozen.parameter_bytes == full.parameter_bytes
    assert (
        full.gradient_bytes - frozen.gradient_bytes == first_layer and frozen.optimizer_bytes == 0
    )
    assert (
        full.activation_bytes - frozen.activation_bytes == 5 * 8 * 4
    )  # x is no longer needed for a gradient
    assert frozen.peak_bytes < full.peak_bytes


def test_measuring_keeps_no_activation_alive():
    """A pack hook that handed the tensor back would store outputs inside their own graph nodes (a cycle
    through C++ the collector cannot see) and leak every measured step's activations."""
    model, x, y = _mlp(), torch.randn(5, 8), torch.tensor([0, 1, 2, 3, 0])

    def live_graph_tensors() -> int:
        gc.collect()
        return sum(
            1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.grad_fn is not None
        )

    before = live_graph_tensors()
    for _ in range(5):
        training_footprint(model, lambda: F.cross_entropy(model(x), y), "adamw")
    assert live_graph_tensors() == before


def test_activation_bytes_equal_what_a_real_graph_holds():
    """Reference: a graph that really keeps its saved tensors (freed by a backward pass afterwards). Without
    holding them during the measurement, a freed temporary's address is reused and counted once for two."""
    torch.manual_seed(0)
    model = nn.Sequential(
        *[layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.1))]
    )
    x, y = torch.randn(16, 32), torch.randint(0, 32, (16,))
    params = {
        (p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()
    }
    seen: dict[tuple[int, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
        if key not in params and key[0] != 0:
            seen[key] = key[1]
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    measured = training_footprint(
        model, lambda: F.cross_entropy(model(x), y), "sgd"
    ).activation_bytes
    assert measured == sum(seen.values()) > 0
