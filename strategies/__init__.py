"""Flower strategies hydrafl adds, and a registry that also names Flower's built-ins."""

from hydrafl.strategies.accumulator import AggregationError, MaskedDeltaAccumulator, WeightedDeltaAccumulator
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.strategies.hydra import TIER_BUDGETS, Hydra, ScoringError, layout_slices
from hydrafl.strategies.registry import STRATEGIES, build_strategy, consumes_deltas

__all__ = [
    "STRATEGIES",
    "TIER_BUDGETS",
    "AggregationError",
    "DiLoCo",
    "Hydra",
    "MaskedDeltaAccumulator",
    "ScoringError",
    "WeightedDeltaAccumulator",
    "build_strategy",
    "consumes_deltas",
    "layout_slices",
]
