"""Flower strategies hydrafl adds, and a registry that also names Flower's built-ins."""

from hydrafl.strategies.accumulator import AggregationError, MaskedDeltaAccumulator, WeightedDeltaAccumulator
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.strategies.fedit import FedIT
from hydrafl.strategies.flexlora import FlexLoRA
from hydrafl.strategies.flora import FLoRA
from hydrafl.strategies.hetlora import HetLoRA
from hydrafl.strategies.fedrolex import FedRolex
from hydrafl.strategies.fjord import FjORD
from hydrafl.strategies.heterofl import HeteroFL
from hydrafl.strategies.hydra import TIER_BUDGETS, Hydra, ScoringError, layout_slices
from hydrafl.strategies.registry import STRATEGIES, build_strategy, consumes_deltas

__all__ = [
    "STRATEGIES",
    "TIER_BUDGETS",
    "AggregationError",
    "DiLoCo",
    "FLoRA",
    "FedIT",
    "FedRolex",
    "FjORD",
    "FlexLoRA",
    "HetLoRA",
    "HeteroFL",
    "Hydra",
    "MaskedDeltaAccumulator",
    "ScoringError",
    "WeightedDeltaAccumulator",
    "build_strategy",
    "consumes_deltas",
    "layout_slices",
]
