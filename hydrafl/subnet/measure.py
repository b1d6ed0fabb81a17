"""A site's `LayerCost`, measured on its own model and data: the step time and peak memory the coordinator's
budget planning (`subnet.planning.plan_budget`) sizes its Hydra-net from.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from hydrafl.footprint import training_footprint
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.planning import LayerCost
from hydrafl.subnet.spec import SubnetSpec


def measure_layer_cost(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    optimizer: str,
    *,
    speed: float = 1.0,
    repeats: int = 2,
    bypass: bool = False,
) -> LayerCost:
    """A site's LayerCost, measured on its own model and data: one training step (forward + backward) with only
    the top layer trained and with every layer trained; memory from `hydrafl.footprint` (exact, so a memory
    budget is deterministic), time the best of `repeats` steps divided by `speed` (a declared slowdown, to
    emulate slower hardware in simulation; 1.0 on a real site, which measures its own device). With `bypass`
    the untrained layers are skipped as a bypassing Hydra-net skips them: their compute and activations leave
    the fixed cost (their weights stay in memory, and in it)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    arch = find_architecture(model)
    num_layers = len(arch.layers)

    def step(layers: tuple[int, ...]) -> tuple[float, float]:
        with apply_spec(model, SubnetSpec(layers=layers, bypass=bypass), arch):
            peak = training_footprint(model, loss, optimizer).peak_bytes
            seconds = []
            with torch.random.fork_rng(devices=[]):
                for _ in range(repeats + 1):  # the first step warms up kernels and allocator
                    started = time.perf_counter()
                    loss().backward()
                    seconds.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        return min(seconds[1:]) / speed, float(peak)

    top_s, top_bytes = step((num_layers - 1,))
    if num_layers == 1:
        return LayerCost(
            fixed_s=top_s / 2,
            per_layer_s=top_s / 2,
            fixed_bytes=top_bytes / 2,
            per_layer_bytes=top_bytes / 2,
        )
    all_s, all_bytes = step(tuple(range(num_layers)))
    per_layer_s = max(all_s - top_s, 0.0) / (num_layers - 1)
    per_layer_bytes = max(all_bytes - top_bytes, 0.0) / (num_layers - 1)
    return LayerCost(
        fixed_s=max(top_s - per_layer_s, 0.0),
        per_layer_s=per_layer_s,
        fixed_bytes=max(top_bytes - per_layer_bytes, 0.0),
        per_layer_bytes=per_layer_bytes,
    )


__all__ = ["measure_layer_cost"]
