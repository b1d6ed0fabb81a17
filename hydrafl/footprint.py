"""What one training step of a site holds in memory, measured on the live model.

Peak training memory = all parameters + a gradient for every parameter that requires one + the optimizer's
state for those + the activations autograd saves for the backward pass. The activations are measured, not
estimated: a `saved_tensors_hooks` pair records every tensor the forward pass keeps (each storage once), so
frozen or bypassed layers, masked heads and narrower widths all show up as they really are in this
implementation. The same number on every device, and comparable across strategies in one simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

OPTIMIZER_STATES = {"adamw": 2, "sgd": 0, "muon": 1, "lm-dual": 0}
"""Tensors of state per trainable parameter (AdamW: two moments; Muon: momentum, AdamW moments for 1-D)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Footprint:
    parameter_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def peak_bytes(self) -> int:
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_bytes
            + self.activation_bytes
        )


def _storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def saved_activation_bytes(
    forward: Callable[[], torch.Tensor], parameters: set[tuple[int, int]]
) -> int:
    """Bytes of the distinct storages autograd saves while `forward()` runs, parameters excluded.

    The graph is measured, never backpropagated, so it stores nothing (handing the tensor itself back would put
    an output inside its own graph node, a reference cycle through C++ that Python's collector cannot see, and
    every measured step's activations would stay alive). The saved tensors are held here instead until the
    forward pass ends, as the graph would hold them: a freed one's address could otherwise be reused by a
    later tensor and counted once for two."""
    seen: dict[tuple[int, int], int] = {}
    held: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        if key not in parameters and key[0] != 0:
            seen[key] = key[1]
            held.append(tensor)

    def unpack(_: None) -> torch.Tensor:
        raise RuntimeError("a footprint measurement's graph cannot be backpropagated")

    # fork_rng: the measuring forward draws no random numbers from training's stream (dropout)
    with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = forward()
    del loss
    held.clear()
    return sum(seen.values())


def training_footprint(
    model: nn.Module, forward: Callable[[], torch.Tensor], optimizer: str
) -> Footprint:
    """The footprint of one step of `forward()` (which returns the loss) with the model as it is configured
    now (frozen parameters, masks and bypasses applied)."""
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    states = OPTIMIZER_STATES.get(optimizer, 2)
    keys = {_storage_key(p) for p in params}
    return Footprint(
        parameter_bytes=sum(p.numel() * p.element_size() for p in params),
        gradient_bytes=trainable_bytes,
        optimizer_bytes=states * trainable_bytes,
        activation_bytes=saved_activation_bytes(forward, keys) if trainable else 0,
    )
