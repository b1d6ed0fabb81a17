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

    top = step((num_layers - 1,))
    every = step(tuple(range(num_layers))) if num_layers > 1 else None
    fixed_s, per_s, fixed_bytes, per_bytes = _linear(top, every, num_layers)
    return LayerCost(
        fixed_s=fixed_s, per_layer_s=per_s, fixed_bytes=fixed_bytes, per_layer_bytes=per_bytes
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

    one = step(1)
    fixed_s, per_s, fixed_bytes, per_bytes = _linear(
        one, step(max_rank) if max_rank > 1 else None, max_rank
    )
    return RankCost(
        fixed_s=fixed_s, per_rank_s=per_s, fixed_bytes=fixed_bytes, per_rank_bytes=per_bytes
    )


def _linear(
    one: tuple[float, float], many: tuple[float, float] | None, units: int
) -> tuple[float, float, float, float]:
    """(fixed s, s per unit, fixed bytes, bytes per unit) of a step whose time and memory grow linearly with the
    units it trains (layers, rank), from the step at one unit and at `units` (None when `units` is 1: the one
    measurement split in half between the fixed part and the unit)."""
    if many is None:
        return one[0] / 2, one[0] / 2, one[1] / 2, one[1] / 2
    per_s = max(many[0] - one[0], 0.0) / (units - 1)
    per_bytes = max(many[1] - one[1], 0.0) / (units - 1)
    return max(one[0] - per_s, 0.0), per_s, max(one[1] - per_bytes, 0.0), per_bytes


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
