"""Hydra: each site trains its own subnetwork (Hydra-net) of the global transformer, sized to its resources.

Sites score layers and heads on their own data in the planning round (`planner.SitePlanner`, before round 1
and every `rescore_every` rounds). The coordinator ranks layers globally (sample-weighted site scores, so
subnetworks nest), gives each site the top layers its tier affords and, in them, the heads its own scores rank
highest. Aggregation is the masked per-coordinate weighted mean of the deltas (`SubnetStrategy`); the outer
step is DiLoCo's on the trained coordinates: outer_lr 1 without momentum is the plain masked mean. Over LoRA
the masked mean and the outer step are taken on each module's product B A, masked to the rows or columns of the
heads a site ran, and factored back to the run's rank: the best rank-R approximation, so heads no site ran move
by that cut when their module was trained; modules no site trained keep A and B.

Design: ../shared/research/hydra-nets.md (Fisher layer scores as in Fed-HeLLo; Michel et al. head importance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from hydrafl import protocol
from hydrafl.strategies.budgets import BudgetConfig
from hydrafl.strategies.diloco import OuterConfig
from hydrafl.strategies.outer import OuterOptimizer
from hydrafl.strategies.planner import EXPERT_SELECTIONS, SitePlanner
from hydrafl.strategies.registry import register
from hydrafl.strategies.subnet_strategy import SubnetStrategy
from hydrafl.subnet.spec import SubnetSpec
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class Hydra(SubnetStrategy):
    """Per-site Hydra-nets: the top layers of the global ranking and, in each, the site's own top heads."""

    def __init__(
        self,
        *,
        bypass: bool = False,
        freeze_heads: bool = True,
        outer: OuterOptimizer | None = None,
        planner: SitePlanner | None = None,
        expert_select: str = "coactivation",
        untiered_experts: float = 1.0,
        **kwargs: Any,
    ) -> None:
        """`outer` None: no outer optimizer, the plain masked mean (`--outer none`, an outer lr 1 step)."""
        planner = planner or SitePlanner()
        planner.scoring[protocol.SCORE_BYPASS] = (
            bypass  # a site measures its step cost as its net will run
        )
        super().__init__(
            planner=planner,
            outer=outer or OuterOptimizer(lr=1.0, momentum=0.0, nesterov=False),
            **kwargs,
        )
        self.bypass, self.freeze_heads = bypass, freeze_heads
        self.expert_select, self.untiered_experts = expert_select, untiered_experts

    def assign(self, node: int, server_round: int, index: int) -> SubnetSpec:
        if self.planner.has_experts(
            node
        ):  # a mixture of experts: the site's experts, in every layer
            return self.planner.expert_spec(
                node,
                selection=self.expert_select,
                untiered=self.untiered_experts,
                server_round=server_round,
                freeze_heads=self.freeze_heads,
            )
        return self.planner.hydra_spec(node, bypass=self.bypass, freeze_heads=self.freeze_heads)


HEAD_MODES = ("freeze", "drop")
HYDRA_LORA = ("products", "factors")
OUTER_OPTIMIZERS = ("none", "nesterov")


@register("hydra")
@dataclass(frozen=True, kw_only=True)
class HydraConfig(BudgetConfig, OuterConfig):
    """Hydra-nets: each site trains the top layers and, in them, its own top heads its budget affords."""

    secure_sum: ClassVar[bool] = True

    hydra_bypass: bool = False
    """A site skips the layers outside its Hydra-net (identity) instead of running them frozen: less compute
    and memory, and it downloads only its Hydra-net; the sites then train a shallower network."""
    hydra_head_mode: str = "freeze"
    """The heads outside a site's net are frozen (they run, untrained, so the site trains the global model's
    own function; it downloads them too) or dropped (masked out of its forward pass). Freezing measured better
    on every benchmark group (`benchmarks/heterogeneous.py`), at the same compute."""
    hydra_lora: str = "products"
    """Over LoRA: average each module's product B A over the heads each site ran and factor it back to the
    run's rank (products), or average A and B apart as FedIT does (factors; its cross terms are noise)."""
    rescore_every: int = 0
    """Sites recompute layer/head scores every this many rounds; 0 scores once, before round 1."""
    outer: str = "none"
    """Outer optimizer over the masked mean delta: none (lr 1) or nesterov (`outer_lr`, `outer_momentum`)."""
    expert_select: str = "coactivation"
    """Mixture-of-experts models: a site trains, in every layer, the experts its tokens route to together
    (coactivation: groups of co-activated experts, by routed share), the most-routed ones (routed), or
    random ones (random, redrawn each round); as many as its tier affords."""
    hydra_experts: float = 1.0
    """Fraction of the experts per layer an untiered site trains (mixture-of-experts models)."""

    def __post_init__(self) -> None:
        BudgetConfig.__post_init__(self)
        OuterConfig.__post_init__(self)
        check(
            self.rescore_every >= 0,
            "rescore-every",
            self.rescore_every,
            "an integer >= 0 (0 = score once)",
        )
        check(
            self.hydra_head_mode in HEAD_MODES,
            "hydra-head-mode",
            self.hydra_head_mode,
            ", ".join(HEAD_MODES),
        )
        check(self.hydra_lora in HYDRA_LORA, "hydra-lora", self.hydra_lora, ", ".join(HYDRA_LORA))
        check(self.outer in OUTER_OPTIMIZERS, "outer", self.outer, ", ".join(OUTER_OPTIMIZERS))
        check(
            self.expert_select in EXPERT_SELECTIONS,
            "expert-select",
            self.expert_select,
            ", ".join(EXPERT_SELECTIONS),
        )
        check(
            0 < self.hydra_experts <= 1, "hydra-experts", self.hydra_experts, "a fraction in (0, 1]"
        )
        self.refuse_ignored(
            ("outer_lr", "outer_momentum", "outer_nesterov"),
            used=self.outer == "nesterov",
            why="with --outer none (hydra's default: the plain masked mean); set --outer nesterov",
        )

    def build(self, run: RunConfig, **common: Any) -> Hydra:
        check(
            not (self.rule().robust and run.lora_rank and self.hydra_lora == "products"),
            "robust-rule",
            self.robust_rule,
            "mean with hydra-lora=products: the robust rules go coordinate by coordinate (set hydra-lora=factors)",
        )
        outer = OuterOptimizer(
            lr=self.outer_lr, momentum=self.outer_momentum, nesterov=self.outer_nesterov
        )
        return Hydra(
            planner=self.planner(run, rescore_every=self.rescore_every),
            bypass=self.hydra_bypass,
            lora_products=self.hydra_lora == "products",
            freeze_heads=self.hydra_head_mode == "freeze",
            robust=self.rule(),
            outer=outer if self.outer == "nesterov" else None,
            expert_select=self.expert_select,
            untiered_experts=self.hydra_experts,
            **common,
        )
