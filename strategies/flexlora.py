"""FlexLoRA: aggregate the full LoRA products, then give each site the best approximation its rank allows.

The server forms W = sum_k (n_k / N) B_k A_k per adapted module (from the factors the sites end with; streamed, one
dense out x in sum per module whatever the number of sites), takes its SVD W = U S V^T and keeps the top-R
components as the global factors B = U_R S_R, A = V_R^T (R = the run's rank). Site k starts from their first r_k
components, which is the SVD truncation of W to rank r_k. The global model evaluated is the rank-R truncation.
Keeping A = V^T orthonormal (S on B) leaves no dead component: a direction with singular value 0 still has a
non-zero A row, so B can grow along it.

Bai, Chen, Chen, Chen, Li, Ding, "Federated Fine-tuning of Large Language Models under Heterogeneous Tasks and
Client Resources", NeurIPS 2024.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Message

from hydrafl.lora_pairs import LoraPair
from hydrafl.strategies.lora import LoraBaseline, LoraBaselineConfig, LoraFold, truncate
from hydrafl.strategies.lora_factors import reply_delta, reply_weight, svd_factors
from hydrafl.strategies.registry import register
from hydrafl.strategies.robust import MaskedRobustAggregator, RobustRule
from hydrafl.subnet.slices import Slice

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class FlexLoRA(LoraBaseline):
    """Sample-weighted mean of the products B_k A_k, SVD-truncated back to the global rank."""

    def fold(self, weights: dict[str, torch.Tensor], pairs: list[LoraPair]) -> LoraFold:
        return _ProductMean(weights, pairs, self.weighted_by_key, self.robust)


class _ProductMean:
    """Streams sum_k n_k B_k A_k per module from the factors each site ends with, then the SVD truncation. Under a
    robust rule, each site's product is held and the rule (over every site: a product is dense) replaces the mean."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        pairs: list[LoraPair],
        weighted_by_key: str,
        robust: RobustRule,
    ) -> None:
        self.start, self.pairs, self.weighted_by_key = weights, pairs, weighted_by_key
        self.products = {
            pair.module: torch.zeros(weights[pair.b].shape[0], weights[pair.a].shape[1])
            for pair in pairs
        }
        self.robust = MaskedRobustAggregator(robust) if robust.robust else None

    def add(self, reply: Message, rank: int) -> None:
        delta, n = reply_delta(reply), reply_weight(reply, self.weighted_by_key)
        for pair in self.pairs:
            a0, b0 = truncate(
                self.start[pair.a], self.start[pair.b], rank
            )  # what the site started from
            if self.robust is not None:
                end = (b0 - delta[pair.b]) @ (a0 - delta[pair.a])
                self.robust.add(pair.module, Slice(None), end, tuple(end.shape))
            else:
                self.products[pair.module].addmm_(b0 - delta[pair.b], a0 - delta[pair.a], alpha=n)

    def finish(self, weights: dict[str, torch.Tensor], total_weight: float) -> None:
        robust = self.robust.aggregate() if self.robust is not None else {}
        for pair in self.pairs:
            mean = (
                robust[pair.module][0] if robust else self.products[pair.module].div_(total_weight)
            )
            weights[pair.b], weights[pair.a] = svd_factors(mean, weights[pair.a].shape[0])


@register("flexlora")
@dataclass(frozen=True, kw_only=True)
class FlexLoRAConfig(LoraBaselineConfig):
    """FlexLoRA: the mean product B A, SVD-truncated to each site's rank (Bai et al., 2024)."""

    def build(self, run: RunConfig, **common: Any) -> FlexLoRA:
        return FlexLoRA(planner=self.planner(run), robust=self.rule(), **common)
