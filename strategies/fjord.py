"""FjORD: ordered dropout. A site of maximum width p_max trains nested leading slices: before every local step it
draws a width p <= p_max, so narrow widths are trained by every site and wide ones only by capable sites. The
coordinator averages each nested block [:p] over the sites with p_max >= p, weighted by their samples, which is
the masked per-coordinate mean over the sites' p_max slices.

Horvath et al., "FjORD: Fair and Accurate Federated Learning under heterogeneous targets with Ordered Dropout",
NeurIPS 2021 (without the optional self-distillation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hydrafl.strategies.budgets import BudgetConfig
from hydrafl.strategies.registry import register
from hydrafl.strategies.subnet_strategy import SubnetStrategy
from hydrafl.strategies.width import WidthPlan
from hydrafl.subnet.spec import SubnetSpec

if TYPE_CHECKING:
    from hydrafl.config import RunConfig

LEVELS = (0.2, 0.4, 0.6, 0.8, 1.0)
"""The paper's uniform width levels; a site draws among those below its p_max, and p_max itself."""


class FjORD(SubnetStrategy):
    """Tier-matched widths as p_max, ordered dropout at the sites, sample-weighted nested averaging."""

    def __init__(self, *, levels: Sequence[float] = LEVELS, **kwargs: Any) -> None:
        super().__init__(lora_products=False, plan=WidthPlan(), **kwargs)
        if not levels or not all(0 < v <= 1 for v in levels):
            raise ValueError(f"FjORD needs width levels in (0, 1], got {list(levels)}")
        self.levels = tuple(sorted(set(levels)))

    def assign(self, node: int, server_round: int, index: int) -> SubnetSpec:
        layers, ratio = self.plan.ratio(self.planner, node, server_round)
        seed = (
            server_round * 1_000_003 + index
        )  # each site draws its own widths, a pure function of the round
        return SubnetSpec(
            layers=layers, width_ratio=ratio, width_levels=self.levels, width_seed=seed
        )


@register("fjord")
@dataclass(frozen=True, kw_only=True)
class FjORDConfig(BudgetConfig):
    """FjORD: ordered dropout over nested widths up to the site's Hydra budget (Horvath et al., 2021)."""

    secure_sum: ClassVar[bool] = True

    def build(self, run: RunConfig, **common: Any) -> FjORD:
        return FjORD(planner=self.planner(run), robust=self.rule(), **common)
