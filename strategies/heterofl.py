"""HeteroFL: each site trains a fixed-width slice of the global model, as wide as its tier affords; a coordinate's
update is the plain mean over the sites whose slice holds it, and coordinates no site trained keep their value.

Diao, Ding, Tarokh, "HeteroFL: Computation and Communication Efficient Federated Learning for Heterogeneous
Clients", ICLR 2021 (fixed rates). How a width slices a transformer: the width section of `hydrafl.hydranet`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from hydrafl.hydranet import Slice, SubnetSpec, WidthAxis, width_for_budget, width_layout_from_heads, width_slices
from hydrafl.strategies.hydra import Hydra, SiteScores, layout_slices


class HeteroFL(Hydra):
    """Hydra's tier-and-layout query and masked update, with one width per site instead of a layer/head selection.

    A site's width is the one whose trained coordinates come closest to what a Hydra-net of its tier trains
    (`hydranet.width_for_budget`), so both methods give every site the same budget in trainable parameters.
    """

    count_once = True
    """HeteroFL averages a coordinate over the sites that trained it, each counting once."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(lora_products=False, **kwargs)  # the paper's rule: each coordinate, LoRA factors too
        self.server_round = 0
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.width_layout: dict[str, WidthAxis] = {}
        self.budgets: dict[int, dict[str, int]] = {}  # per round, per tier: the Hydra-net budget its width matches

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        self.server_round, self.width_layout = server_round, {}
        self.shapes = {name: tuple(arrays[name].shape) for name in arrays}
        self.budgets[server_round] = {}
        return super().configure_train(server_round, arrays, config, grid)

    def _spec(self, scores: SiteScores) -> SubnetSpec:
        """Every layer, at the width whose trainable parameters match the site's Hydra-net of the same tier."""
        if not self.width_layout:
            self.width_layout = width_layout_from_heads(self.layout, self.shapes)
        hydra = super()._spec(scores)
        budget = sum(sl.numel(self.shapes[name]) for name, sl in layout_slices(self.layout, hydra).items())
        layers = tuple(range(len(self.ranking)))
        ratio, _ = width_for_budget(self.width_layout, budget, layers)
        self.budgets[self.server_round][scores.tier or "untiered"] = budget
        return SubnetSpec(layers=layers, **self._width(ratio))

    def _width(self, ratio: float) -> dict[str, Any]:
        """The width fields of this round's spec for a site of width `ratio`."""
        return {"width_ratio": ratio}

    def site_slices(self, node: int) -> dict[str, Slice]:
        return width_slices(self.width_layout, self.specs[node])

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "budgets": {r: dict(b) for r, b in self.budgets.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.budgets = {r: dict(b) for r, b in state["budgets"].items()}
