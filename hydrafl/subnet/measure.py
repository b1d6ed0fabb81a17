"""A site's `LayerCost` and `RankCost`, measured on its own model and data: the step time and peak memory the
coordinator's budget planning sizes its Hydra-net (`subnet.planning.plan_budget`) and a LoRA baseline's rank
(`subnet.planning.fit_rank`) from, with the same footprint measurement (`hydrafl.footprint`) for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from hydrafl.footprint import training_footprint
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.planning import LayerCost, RankCost
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
            return _step_cost(model, loss, optimizer, speed=speed, repeats=repeats)

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


def measure_rank_cost(
    build: Callable[[int], nn.Module],
    loss: Callable[[nn.Module], torch.Tensor],
    optimizer: str,
    *,
    max_rank: int,
    speed: float = 1.0,
    repeats: int = 2,
) -> RankCost:
    """A LoRA site's RankCost: one training step of the model `build(r)` returns (every layer, a rank-r
    adapter) at r = 1 and r = max_rank, measured as `measure_layer_cost` measures a Hydra-net's."""
    if speed <= 0 or max_rank < 1:
        raise ValueError(f"speed and max_rank must be > 0, got {speed}, {max_rank}")

    def step(rank: int) -> tuple[float, float]:
        model = build(rank)
        return _step_cost(model, lambda: loss(model), optimizer, speed=speed, repeats=repeats)

    one_s, one_bytes = step(1)
    if max_rank == 1:
        half_s, half_bytes = one_s / 2, one_bytes / 2
        return RankCost(
            fixed_s=half_s, per_rank_s=half_s, fixed_bytes=half_bytes, per_rank_bytes=half_bytes
        )
    top_s, top_bytes = step(max_rank)
    per_rank_s = max(top_s - one_s, 0.0) / (max_rank - 1)
    per_rank_bytes = max(top_bytes - one_bytes, 0.0) / (max_rank - 1)
    return RankCost(
        fixed_s=max(one_s - per_rank_s, 0.0),
        per_rank_s=per_rank_s,
        fixed_bytes=max(one_bytes - per_rank_bytes, 0.0),
        per_rank_bytes=per_rank_bytes,
    )


def _step_cost(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    optimizer: str,
    *,
    speed: float,
    repeats: int,
) -> tuple[float, float]:
    """(seconds, peak bytes) of one training step of the model as it is configured now: the footprint, and
    the best of `repeats` timed steps divided by `speed`."""
    peak = training_footprint(model, loss, optimizer).peak_bytes
    seconds = []
    with torch.random.fork_rng(devices=[]):
        for _ in range(repeats + 1):  # the first step warms up kernels and allocator
            started = time.perf_counter()
            loss().backward()
            seconds.append(time.perf_counter() - started)
    model.zero_grad(set_to_none=True)
    return min(seconds[1:]) / speed, float(peak)


__all__ = ["measure_layer_cost", "measure_rank_cost"]
