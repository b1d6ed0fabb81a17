"""FLoRA: stack the sites' heterogeneous-rank LoRA modules, so the aggregate is exactly sum_k p_k B_k A_k.

Stacking A = [p_1 A_1; ...; p_K A_K] and B = [B_1, ..., B_K] gives B A = sum_k p_k B_k A_k with no cross terms
(p_k = n_k / N). The stacked module is merged into the frozen base weights, W <- W + (alpha / R) sum_k p_k B_k A_k,
and every site restarts each round from a fresh LoRA of its rank (A random as PEFT initialises it, B = 0). The server
streams the product sum (one dense out x in sum per module, whatever the number of sites) instead of holding the
stack. Sites keep no state between rounds here, so the merged base weights travel with the adapters (the site's
`query.init` adds them for this strategy): FLoRA's download is the dense attention weights, not just the factors.

Wang, Shen, Chen, Li, Chen, Gao, "FLoRA: Federated Fine-Tuning Large Language Models with Heterogeneous Low-Rank
Adaptations", NeurIPS 2024.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ArrayRecord, Message

from hydrafl.arrays import to_record
from hydrafl.lora_pairs import LoraPair
from hydrafl.strategies.accumulator import AggregationError
from hydrafl.strategies.lora import LoraBaseline, LoraBaselineConfig, LoraFold, truncate
from hydrafl.strategies.lora_factors import reply_delta, reply_weight
from hydrafl.strategies.registry import register

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class FLoRA(LoraBaseline):
    """Sample-weighted sum of the sites' products merged into the base weights; fresh adapters every round."""

    def __init__(self, *, alpha: float = 16.0, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if alpha <= 0:
            raise ValueError(f"FLoRA needs the LoRA alpha > 0, got {alpha}")
        self.alpha, self.seed = alpha, seed

    def _site_arrays(
        self, node: int, rank: int, arrays: ArrayRecord, pairs: list[LoraPair]
    ) -> ArrayRecord:
        missing = [pair.base for pair in pairs if pair.base not in arrays]
        if missing:
            raise AggregationError(
                f"FLoRA merges into the base weights, but the global arrays lack {missing[:2]}"
            )
        factors = self.fresh_factors(node, rank, arrays, pairs)
        return ArrayRecord({**{name: arrays[name] for name in arrays}, **to_record(factors)})

    def fresh_factors(
        self, node: int, rank: int, arrays: Mapping[str, Any], pairs: list[LoraPair]
    ) -> dict[str, torch.Tensor]:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform) in the first `rank` rows, B = 0; a pure
        function of (seed, round, node), so aggregation regenerates it instead of keeping one copy per site."""
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.server_round * 10_007 + node) % 2**63
        )
        factors = {}
        for pair in pairs:
            (r, fan_in), out = arrays[pair.a].shape, arrays[pair.b].shape[0]
            a = (torch.rand(r, fan_in, generator=generator) * 2 - 1) / math.sqrt(fan_in)
            factors[pair.a], factors[pair.b] = truncate(a, torch.zeros(out, r), rank)
        return factors

    def fold(self, weights: dict[str, torch.Tensor], pairs: list[LoraPair]) -> LoraFold:
        return _MergedProducts(self, weights, pairs)


class _MergedProducts:
    """Streams sum_k n_k B_k A_k per module (one dense sum whatever the number of sites), then merges
    (alpha / R) / N times it into the base weights."""

    def __init__(
        self, strategy: FLoRA, weights: dict[str, torch.Tensor], pairs: list[LoraPair]
    ) -> None:
        self.strategy, self.start, self.pairs = strategy, weights, pairs
        self.products: dict[str, torch.Tensor] = {}

    def add(self, reply: Message, rank: int) -> None:
        delta, n = reply_delta(reply), reply_weight(reply, self.strategy.weighted_by_key)
        start = self.strategy.fresh_factors(
            reply.metadata.src_node_id, rank, self.start, self.pairs
        )
        for pair in self.pairs:
            b, a = start[pair.b] - delta[pair.b], start[pair.a] - delta[pair.a]
            previous = self.products.get(pair.module, torch.zeros(b.shape[0], a.shape[1]))
            self.products[pair.module] = torch.addmm(previous, b, a, alpha=n)

    def finish(self, weights: dict[str, torch.Tensor], total_weight: float) -> None:
        for pair in self.pairs:
            scale = (
                self.strategy.alpha / weights[pair.a].shape[0] / total_weight
            )  # PEFT's alpha / R, and 1 / N
            weights[pair.base] = weights[pair.base] + scale * self.products[pair.module]


@register("flora")
@dataclass(frozen=True, kw_only=True)
class FLoRAConfig(LoraBaselineConfig):
    """FLoRA: stacked heterogeneous-rank adapters merged into the base weights (Wang et al., 2024)."""

    lora_bases_travel: ClassVar[bool] = True
    refuses_robust_rule: ClassVar[str] = (
        "FLoRA stacks each site's factors, so its aggregate is no per-coordinate sum to take a median of"
    )

    def build(self, run: RunConfig, **common: Any) -> FLoRA:
        return FLoRA(planner=self.planner(run), alpha=run.lora_alpha, seed=run.seed, **common)
