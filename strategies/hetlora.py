"""HetLoRA: heterogeneous ranks, zero-padded to the largest, aggregated with sparsity weights, truncated back.

Site k starts from the global factors truncated to its rank r_k. The server zero-pads what comes back to the
global rank R and takes, per adapted module, the average of the factors weighted by p_k = ||B_k A_k||_F /
sum_j ||B_j A_j||_F (sites whose update is larger weigh more); the head is sample-weighted FedAvg. Rank
self-pruning: when the norm of a site's last `prune` fraction of rank components, ||B_tail A_tail||_F summed over
modules, ends its local training below where it started, the site drops them: r_k <- max(1, floor((1 - prune) r_k)).
As in the paper, each site trains on its task loss plus lambda ||B_tail A_tail||_F (`TailPenalised`, lambda =
`tail_penalty`), which pushes that tail down unless the data hold it up.

Cho, Manoel, Joshi, Sahu, "Heterogeneous LoRA for Federated Fine-tuning of On-Device Foundation Models", EMNLP 2024.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord, Message, MetricRecord
from torch import nn

from hydrafl.arrays import from_record, to_record
from hydrafl.losses import LossFn
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.lora import LoraBaseline, step_outside_factors, truncate
from hydrafl.strategies.lora_factors import lora_pairs, reply_delta


TAIL_PENALTY_KEY = "hetlora.tail-penalty"
PRUNE_KEY = "hetlora.prune"
"""Train config keys of a HetLoRA site's local regulariser: lambda, and the rank fraction that is the tail."""


@dataclass(frozen=True, slots=True)
class TailPenalised:
    """A HetLoRA site's loss: its task loss plus lambda * sum over adapted modules of ||B_tail A_tail||_F, the
    components of its rank a self-pruning step would drop. Picklable, so multi-process sites use it too."""

    loss: LossFn
    weight: float
    rank: int
    prune: float

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        value = self.loss(model, x, y)
        keep = _pruned(self.rank, self.prune)
        if keep >= self.rank or not self.weight:
            return value
        params = dict(model.named_parameters())
        tail = sum(_smooth_norm(params[p.b][:, keep : self.rank] @ params[p.a][keep : self.rank]) for p in lora_pairs(params))
        return value + self.weight * tail


def _smooth_norm(matrix: torch.Tensor) -> torch.Tensor:
    """||matrix||_F with a finite (zero) gradient at 0, where the tail of fresh adapters starts."""
    return torch.sqrt(matrix.square().sum() + 1e-12)


class HetLoRA(LoraBaseline):
    """Sparsity-weighted average of zero-padded factors, with per-site rank self-pruning."""

    def __init__(self, *, prune: float = 0.1, tail_penalty: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 <= prune < 1 or tail_penalty < 0:
            raise ValueError(f"HetLoRA needs 0 <= prune < 1 and tail_penalty >= 0, got {prune}, {tail_penalty}")
        self.prune, self.tail_penalty = prune, tail_penalty

    def site_config(self) -> dict[str, float]:
        return {TAIL_PENALTY_KEY: self.tail_penalty, PRUNE_KEY: self.prune} if self.tail_penalty else {}

    def aggregate_lora(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        weights = from_record(self.current_arrays)
        pairs = lora_pairs(weights)
        head = WeightedDeltaAccumulator(self.weighted_by_key)  # sums every array; only non-factors are used
        sums = {name: torch.zeros_like(weights[name]) for pair in pairs for name in (pair.a, pair.b)}
        norms = {pair.module: 0.0 for pair in pairs}
        for reply in replies:
            if reply.has_error():
                continue
            head.add(reply)
            node, rank = reply.metadata.src_node_id, self._rank_of(reply)
            delta, tail = reply_delta(reply), [0.0, 0.0]
            for pair in pairs:
                a0, b0 = truncate(weights[pair.a], weights[pair.b], rank)  # what the site started from
                a, b = a0 - delta.get(pair.a, 0.0), b0 - delta.get(pair.b, 0.0)
                norm = float(torch.linalg.matrix_norm(b @ a))
                sums[pair.a].add_(a, alpha=norm)
                sums[pair.b].add_(b, alpha=norm)
                norms[pair.module] += norm
                tail[0] += _tail_norm(a0, b0, rank, self.prune)
                tail[1] += _tail_norm(a, b, rank, self.prune)
            if tail[1] < tail[0]:
                self.ranks[node] = _pruned(rank, self.prune)
        if not head.metric_records:
            return None, None
        step_outside_factors(weights, head, pairs)
        for pair in pairs:
            if norms[pair.module] > 0:  # all-zero updates (nothing trained) keep the module as it was
                weights[pair.a] = sums[pair.a].div_(norms[pair.module])
                weights[pair.b] = sums[pair.b].div_(norms[pair.module])
        return to_record(weights), self.train_metrics_aggr_fn(head.metric_records, self.weighted_by_key)


def _pruned(rank: int, prune: float) -> int:
    return max(1, math.floor((1 - prune) * rank))


def _tail_norm(a: torch.Tensor, b: torch.Tensor, rank: int, prune: float) -> float:
    """||B_tail A_tail||_F over the components a pruning step would drop (none when it would drop none)."""
    keep = _pruned(rank, prune)
    return float(torch.linalg.matrix_norm(b[:, keep:rank] @ a[keep:rank])) if keep < rank else 0.0
