"""FedIT: FedAvg of the LoRA factors A and B (and the head), each averaged on its own. The mean of the factors is
not the mean of the products B_k A_k (the cross terms are the noise FLoRA and FlexLoRA remove): this is the
reference point. With tiers, sites train nested ranks and a rank component is averaged over the sites that trained
it (sample-weighted, as FedAvg); components no site trained keep their value. Without tiers it is plain FedAvg.

Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import from_record, to_record
from hydrafl.hydranet import coordinate_masks
from hydrafl.strategies.accumulator import MaskedDeltaAccumulator
from hydrafl.strategies.lora import LoraBaseline, rank_slices, trainable_names
from hydrafl.strategies.lora_factors import lora_pairs


class FedIT(LoraBaseline):
    """Per-coordinate sample-weighted mean of the factor deltas over the sites whose rank covers them."""

    def aggregate_lora(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        weights = from_record(self.current_arrays)
        names = trainable_names(weights, lora_pairs(weights))
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        for reply in replies:
            if not reply.has_error():
                accumulator.add(reply, coordinate_masks(rank_slices(names, self._rank_of(reply)), weights))
        if not accumulator.metric_records:
            return None, None
        for name, (delta, trained) in accumulator.mean().items():
            weights[name] = torch.where(trained, weights[name] - delta, weights[name])
        return to_record(weights), self.train_metrics_aggr_fn(accumulator.metric_records, self.weighted_by_key)
