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
from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.accumulator import AggregationError, WeightedDeltaAccumulator
from hydrafl.strategies.lora import LoraBaseline, step_outside_factors, truncate
from hydrafl.strategies.lora_factors import LoraPair, lora_pairs, reply_delta, reply_weight


class FLoRA(LoraBaseline):
    """Sample-weighted sum of the sites' products merged into the base weights; fresh adapters every round."""

    def __init__(self, *, alpha: float = 16.0, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if alpha <= 0:
            raise ValueError(f"FLoRA needs the LoRA alpha > 0, got {alpha}")
        self.alpha, self.seed = alpha, seed

    def _site_arrays(self, node: int, rank: int, arrays: ArrayRecord, pairs: list[LoraPair]) -> ArrayRecord:
        missing = [pair.base for pair in pairs if pair.base not in arrays]
        if missing:
            raise AggregationError(f"FLoRA merges into the base weights, but the global arrays lack {missing[:2]}")
        factors = self._fresh_factors(node, rank, arrays, pairs)
        return ArrayRecord({**{name: arrays[name] for name in arrays}, **to_record(factors)})

    def _fresh_factors(self, node: int, rank: int, arrays: ArrayRecord, pairs: list[LoraPair]) -> dict[str, torch.Tensor]:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform) in the first `rank` rows, B = 0; a pure
        function of (seed, round, node), so aggregation regenerates it instead of keeping one copy per site."""
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.server_round * 10_007 + node) % 2**63)
        factors = {}
        for pair in pairs:
            (r, fan_in), out = arrays[pair.a].shape, arrays[pair.b].shape[0]
            a = (torch.rand(r, fan_in, generator=generator) * 2 - 1) / math.sqrt(fan_in)
            factors[pair.a], factors[pair.b] = truncate(a, torch.zeros(out, r), rank)
        return factors

    def aggregate_lora(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        pairs = lora_pairs(self.current_arrays)
        head = WeightedDeltaAccumulator(self.weighted_by_key)  # sums every array; only non-factors are used
        products: dict[str, torch.Tensor] = {}
        for reply in replies:
            if reply.has_error():
                continue
            head.add(reply)
            node, delta, n = reply.metadata.src_node_id, reply_delta(reply), reply_weight(reply, self.weighted_by_key)
            start = self._fresh_factors(node, self._rank_of(reply), self.current_arrays, pairs)
            for pair in pairs:
                b, a = start[pair.b] - delta[pair.b], start[pair.a] - delta[pair.a]
                products[pair.module] = torch.addmm(products.get(pair.module, torch.zeros(b.shape[0], a.shape[1])), b, a, alpha=n)
        if not head.metric_records:
            return None, None
        weights = from_record(self.current_arrays)
        step_outside_factors(weights, head, pairs)
        for pair in pairs:
            scale = self.alpha / weights[pair.a].shape[0] / head.total_weight  # PEFT's alpha / R, and 1 / N
            weights[pair.base] = weights[pair.base] + scale * products[pair.module]
        return to_record(weights), self.train_metrics_aggr_fn(head.metric_records, self.weighted_by_key)
