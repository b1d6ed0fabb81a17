"""Flower strategies hydrafl adds, and a registry that also names Flower's built-ins."""

from hydrafl.strategies.accumulator import AggregationError, WeightedDeltaAccumulator
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.strategies.registry import STRATEGIES, build_strategy, consumes_deltas

__all__ = [
    "STRATEGIES",
    "AggregationError",
    "DiLoCo",
    "WeightedDeltaAccumulator",
    "build_strategy",
    "consumes_deltas",
]
