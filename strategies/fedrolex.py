"""FedRolex: HeteroFL whose kept channels are a rolling window: at round t every block keeps the channels
t-1, t, ... (mod the block size, wrapping around), so over rounds every coordinate is trained even by narrow
sites. Same plain mean over the sites that trained a coordinate.

Alam, Liu, Yan, Zhang, "FedRolex: Model-Heterogeneous Federated Learning with Rolling Sub-Model Extraction",
NeurIPS 2022.
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


class FedRolex(SubnetStrategy):
    """Tier-matched widths whose window advances by one channel per round."""

    count_once = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(lora_products=False, plan=WidthPlan(), **kwargs)

    def assign(self, node: int, server_round: int, index: int) -> SubnetSpec:
        layers, ratio = self.plan.ratio(self.planner, node, server_round)
        return SubnetSpec(layers=layers, width_ratio=ratio, width_offset=server_round - 1)


@register("fedrolex")
@dataclass(frozen=True, kw_only=True)
class FedRolexConfig(BudgetConfig):
    """FedRolex: HeteroFL with a width window rolling by one channel per round (Alam et al., 2022)."""

    secure_sum: ClassVar[bool] = True

    def build(self, run: RunConfig, **common: Any) -> FedRolex:
        return FedRolex(planner=self.planner(run), robust=self.rule(), **common)
