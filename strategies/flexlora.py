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

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.lora import LoraBaseline, step_outside_factors, truncate
from hydrafl.strategies.lora_factors import lora_pairs, reply_delta, reply_weight, svd_factors


class FlexLoRA(LoraBaseline):
    """Sample-weighted mean of the products B_k A_k, SVD-truncated back to the global rank."""

    def aggregate_lora(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        weights = from_record(self.current_arrays)
        pairs = lora_pairs(weights)
        head = WeightedDeltaAccumulator(self.weighted_by_key)  # sums every array; only non-factors are used
        products = {pair.module: torch.zeros(weights[pair.b].shape[0], weights[pair.a].shape[1]) for pair in pairs}
        for reply in replies:
            if reply.has_error():
                continue
            head.add(reply)
            rank, delta, n = self._rank_of(reply), reply_delta(reply), reply_weight(reply, self.weighted_by_key)
            for pair in pairs:
                a0, b0 = truncate(weights[pair.a], weights[pair.b], rank)  # what the site started from
                products[pair.module].addmm_(b0 - delta[pair.b], a0 - delta[pair.a], alpha=n)
        if not head.metric_records:
            return None, None
        step_outside_factors(weights, head, pairs)
        for pair in pairs:
            weights[pair.b], weights[pair.a] = svd_factors(products[pair.module].div_(head.total_weight), weights[pair.a].shape[0])
        return to_record(weights), self.train_metrics_aggr_fn(head.metric_records, self.weighted_by_key)

