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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import Message

from hydrafl import protocol
from hydrafl.lora_pairs import LoraPair, pruned_rank
from hydrafl.strategies.lora import LoraBaseline, LoraBaselineConfig, LoraFold, truncate
from hydrafl.strategies.lora_factors import reply_delta
from hydrafl.strategies.registry import register
from hydrafl.strategies.robust import MaskedRobustAggregator
from hydrafl.subnet.slices import Slice
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class HetLoRA(LoraBaseline):
    """Sparsity-weighted average of zero-padded factors, with per-site rank self-pruning."""

    def __init__(self, *, prune: float = 0.1, tail_penalty: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0 <= prune < 1 or tail_penalty < 0:
            raise ValueError(
                f"HetLoRA needs 0 <= prune < 1 and tail_penalty >= 0, got {prune}, {tail_penalty}"
            )
        self.prune, self.tail_penalty = prune, tail_penalty

    def site_config(self) -> dict[str, float]:
        return (
            {protocol.TAIL_PENALTY: self.tail_penalty, protocol.TAIL_PRUNE: self.prune}
            if self.tail_penalty
            else {}
        )

    def fold(self, weights: dict[str, torch.Tensor], pairs: list[LoraPair]) -> LoraFold:
        return _SparsityWeighted(self, weights, pairs)


class _SparsityWeighted:
    """Streams the factors weighted by ||B_k A_k||_F and each site's tail norms (its pruning decision). Under a
    robust rule, the sites' end factors are held instead and each rank component takes the rule over the sites
    whose rank holds it (no sparsity weights, no zero padding); components no site holds keep their value."""

    def __init__(
        self, strategy: HetLoRA, weights: dict[str, torch.Tensor], pairs: list[LoraPair]
    ) -> None:
        self.strategy, self.start, self.pairs = strategy, weights, pairs
        self.robust = MaskedRobustAggregator(strategy.robust) if strategy.robust.robust else None
        self.sums = {
            name: torch.zeros_like(weights[name]) for pair in pairs for name in (pair.a, pair.b)
        }
        self.norms = {pair.module: 0.0 for pair in pairs}

    def add(self, reply: Message, rank: int) -> None:
        prune, delta, tail = self.strategy.prune, reply_delta(reply), [0.0, 0.0]
        for pair in self.pairs:
            a0, b0 = truncate(
                self.start[pair.a], self.start[pair.b], rank
            )  # what the site started from
            a, b = a0 - delta.get(pair.a, 0.0), b0 - delta.get(pair.b, 0.0)
            norm = float(torch.linalg.matrix_norm(b @ a))
            if self.robust is not None:
                components = range(rank)
                self.robust.add(pair.a, Slice(0, components), a[:rank], tuple(a.shape))
                self.robust.add(pair.b, Slice(1, components), b[:, :rank], tuple(b.shape))
            self.sums[pair.a].add_(a, alpha=norm)
            self.sums[pair.b].add_(b, alpha=norm)
            self.norms[pair.module] += norm
            tail[0] += _tail_norm(a0, b0, rank, prune)
            tail[1] += _tail_norm(a, b, rank, prune)
        if tail[1] < tail[0]:
            self.strategy.ranks[reply.metadata.src_node_id] = pruned_rank(rank, prune)

    def finish(self, weights: dict[str, torch.Tensor], total_weight: float) -> None:
        if self.robust is not None:
            for name, (factor, held) in self.robust.aggregate().items():
                weights[name] = torch.where(held, factor, weights[name])
            return
        for pair in self.pairs:
            if (
                self.norms[pair.module] > 0
            ):  # all-zero updates (nothing trained) keep the module as it was
                weights[pair.a] = self.sums[pair.a].div_(self.norms[pair.module])
                weights[pair.b] = self.sums[pair.b].div_(self.norms[pair.module])


def _tail_norm(a: torch.Tensor, b: torch.Tensor, rank: int, prune: float) -> float:
    """||B_tail A_tail||_F over the components a pruning step would drop (none when it would drop none)."""
    keep = pruned_rank(rank, prune)
    return float(torch.linalg.matrix_norm(b[:, keep:rank] @ a[keep:rank])) if keep < rank else 0.0


@register("hetlora")
@dataclass(frozen=True, kw_only=True)
class HetLoRAConfig(LoraBaselineConfig):
    """HetLoRA: sparsity-weighted zero-padded factors with rank self-pruning (Cho et al., 2024)."""

    hetlora_prune: float = 0.1
    """Rank self-pruning: the fraction of a site's rank dropped when its tail shrinks in training."""
    hetlora_tail_penalty: float = 1e-3
    """lambda of the sites' local regulariser lambda * ||B_tail A_tail||_F on the rank components a
    self-pruning step would drop (0 = none); their reported train loss includes it."""

    def __post_init__(self) -> None:
        LoraBaselineConfig.__post_init__(self)
        check(
            0 <= self.hetlora_prune < 1, "hetlora-prune", self.hetlora_prune, "a fraction in [0, 1)"
        )
        check(
            self.hetlora_tail_penalty >= 0,
            "hetlora-tail-penalty",
            self.hetlora_tail_penalty,
            "a float >= 0",
        )

    def build(self, run: RunConfig, **common: Any) -> HetLoRA:
        return HetLoRA(
            planner=self.planner(run),
            prune=self.hetlora_prune,
            tail_penalty=self.hetlora_tail_penalty,
            robust=self.rule(),
            **common,
        )
