"""What the width baselines (HeteroFL, FjORD, FedRolex) share: one width per site, the one whose trained
coordinates come closest to what a Hydra-net of its tier trains (`subnet.width.width_for_budget`), so every
method gives a site the same budget in trainable parameters. How a width slices a transformer: `subnet.width`."""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord

from hydrafl.strategies.planner import SitePlanner
from hydrafl.subnet.slices import Slice
from hydrafl.subnet.spec import SubnetSpec
from hydrafl.subnet.width import WidthAxis, width_for_budget, width_layout_from_heads, width_slices


class WidthPlan:
    """Per round: the global arrays' width axes and each site's width ratio."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.layout: dict[str, WidthAxis] = {}
        self.budgets: dict[int, dict[str, int]] = {}
        """Per round, per tier: the Hydra-net budget the tier's width matches."""

    def start_round(self, server_round: int, arrays: ArrayRecord) -> None:
        self.shapes = {name: tuple(arrays[name].shape) for name in arrays}
        self.layout, self.budgets[server_round] = {}, {}

    def ratio(
        self, planner: SitePlanner, node: int, server_round: int
    ) -> tuple[tuple[int, ...], float]:
        """Every layer, and the width whose trainable parameters match the node's Hydra-net."""
        if not self.layout:
            self.layout = width_layout_from_heads(planner.layout, self.shapes)
        budget = planner.budget(node, self.shapes)
        layers = tuple(range(len(planner.ranking)))
        ratio, _ = width_for_budget(self.layout, budget, layers)
        self.budgets[server_round][planner.site_scores[node].tier or "untiered"] = budget
        return layers, ratio

    def slices(self, spec: SubnetSpec) -> dict[str, Slice]:
        return width_slices(self.layout, spec)

    def state_dict(self) -> dict[str, Any]:
        return {"budgets": {r: dict(b) for r, b in self.budgets.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.budgets = {r: dict(b) for r, b in state["budgets"].items()}
