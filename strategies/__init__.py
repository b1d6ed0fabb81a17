"""Flower strategies hydrafl adds, and Flower's built-ins, each registered under its name with its knobs.

Nothing is imported until it is used: reading a run's configuration (the coordinator's CLI, a site) touches
only `registry`, and a strategy's module, with torch and Flower, loads when the strategy is first named.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "AggregationError": "accumulator",
    "MaskedDeltaAccumulator": "accumulator",
    "WeightedDeltaAccumulator": "accumulator",
    "DiLoCo": "diloco",
    "FedBuff": "fedbuff",
    "FedBuffHydra": "fedbuff_hydra",
    "FedIT": "fedit",
    "FedRolex": "fedrolex",
    "FjORD": "fjord",
    "FlexLoRA": "flexlora",
    "FLoRA": "flora",
    "HeteroFL": "heterofl",
    "HetLoRA": "hetlora",
    "Hydra": "hydra",
    "ScoringError": "planner",
    "TIER_BUDGETS": "planner",
    "StrategyConfig": "registry",
    "build_strategy": "registry",
    "register": "registry",
    "strategy_names": "registry",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
