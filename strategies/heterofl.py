"""HeteroFL: each site trains a fixed-width slice of the global model, as wide as its tier affords; a coordinate's
update is the plain mean over the sites whose slice holds it, and coordinates no site trained keep their value.

Diao, Ding, Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous
Clients", ICLR 2021 (fixed rates). How a width slices a transformer: `hydrafl.subnet.width`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hydrafl.strategies.budgets import BudgetConfig
from hydrafl.strategies.registry import register
from hydrafl.strategies.subnet_strategy import SubnetStrategy
from hydrafl.strategies.width import WidthPlan
from hydrafl.subnet.spec import SubnetSpec

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class HeteroFL(SubnetStrategy):
    """The planning round's budgets, one width per site instead of a layer/head selection."""

    count_once = True

    def __init__(self, **kwargs: Any) -> None:
        # the paper's rule: each coordinate on its own, LoRA factors too
        super().__init__(lora_products=False, plan=WidthPlan(), **kwargs)

    def assign(self, node: int, server_round: int, index: int) -> SubnetSpec:
        layers, ratio = self.plan.ratio(self.planner, node, server_round)
        return SubnetSpec(layers=layers, width_ratio=ratio)


@register("heterofl")
@dataclass(frozen=True, kw_only=True)
class HeteroFLConfig(BudgetConfig):
    """HeteroFL: each site trains a fixed-width slice as wide as its Hydra budget (Diao et al., 2021)."""

    secure_sum: ClassVar[bool] = True

    def build(self, run: RunConfig, **common: Any) -> HeteroFL:
        return HeteroFL(planner=self.planner(run), robust=self.rule(), **common)
