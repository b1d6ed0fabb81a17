"""FedIT: FedAvg of the LoRA factors A and B (and the head), each averaged on its own. The mean of the factors is
not the mean of the products B_k A_k (the cross terms are the noise FLoRA and FlexLoRA remove): this is the
reference point. With tiers, sites train nested ranks and a rank component is averaged over the sites that trained
it (sample-weighted, as FedAvg); components no site trained keep their value. Without tiers it is plain FedAvg.

Zhang et al., "Towards Building the Federated GPT: Federated Instruction Tuning", ICASSP 2024.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ArrayRecord, Message, MetricRecord

from hydrafl.arrays import from_record, to_record
from hydrafl.lora_pairs import LoraPair, lora_pairs
from hydrafl.strategies.accumulator import MaskedDeltaAccumulator
from hydrafl.strategies.lora import (
    LoraBaseline,
    LoraBaselineConfig,
    LoraFold,
    rank_slices,
    trainable_names,
)
from hydrafl.strategies.lora_factors import reply_delta
from hydrafl.strategies.registry import register
from hydrafl.strategies.robust import MaskedRobustAggregator, RobustRule
from hydrafl.subnet.slices import Slice, coordinate_masks

if TYPE_CHECKING:
    from hydrafl.config import RunConfig
    from hydrafl.privacy.central import CentralDp


class FedIT(LoraBaseline):
    """Per-coordinate sample-weighted mean of the factor deltas over the sites whose rank covers them. The mean
    is linear in each site's update, so central DP applies: clipped updates, each site counted once, noise
    z C / n_k on a factor coordinate that n_k sites' ranks cover. For the same reason it takes secure sums
    (`hooks.TakesSecureSums`): each site's rank slices, weighted by its examples."""

    count_once = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.central_dp: CentralDp | None = None
        """Central DP (`hydrafl.privacy.central.with_central_dp` sets it): the head's and the factors' means."""

    def head_dp(self) -> CentralDp | None:
        return self.central_dp

    def fold(self, weights: dict[str, torch.Tensor], pairs: list[LoraPair]) -> LoraFold:
        return _MaskedFactors(weights, pairs, self.weighted_by_key, self.robust, self.central_dp)

    def site_slices(self, node: int) -> dict[str, Slice]:
        return rank_slices(
            trainable_names(self.current_arrays, lora_pairs(self.current_arrays)), self.ranks[node]
        )

    def aggregate_summed(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The masked mean from the survivors' per-coordinate sums: the head over every site, each factor
        component over the sites whose rank covers it (the rest keep their value), as `aggregate_train`."""
        if self.current_arrays is None:
            return None, None
        weights = from_record(self.current_arrays)
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        for reply in replies:
            accumulator.add_sums(reply)
        for name, (delta, trained) in accumulator.mean().items():
            weights[name] = torch.where(trained, weights[name] - delta, weights[name])
        return to_record(weights), self.train_metrics_aggr_fn(
            accumulator.metric_records, self.weighted_by_key
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **(self.central_dp.state_dict() if self.central_dp else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self.central_dp:
            self.central_dp.load_state_dict(state)


class _MaskedFactors:
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        pairs: list[LoraPair],
        weighted_by_key: str,
        robust: RobustRule,
        dp: CentralDp | None,
    ) -> None:
        self.start, self.names = weights, trainable_names(weights, pairs)
        self.factors = {name for pair in pairs for name in (pair.a, pair.b)}
        self.accumulator = MaskedDeltaAccumulator(weighted_by_key, dp=dp and dp.round_copy())
        self.robust = MaskedRobustAggregator(robust) if robust.robust else None

    def add(self, reply: Message, rank: int) -> None:
        slices = rank_slices(self.names, rank)
        self.accumulator.add(reply, coordinate_masks(slices, self.start))
        if self.robust is not None:  # the components of the site's rank, compact
            for name, delta in reply_delta(reply, self.factors).items():
                self.robust.add(
                    name, slices[name], slices[name].take(delta), tuple(self.start[name].shape)
                )

    def finish(self, weights: dict[str, torch.Tensor], total_weight: float) -> None:
        means = (
            self.robust.aggregate()
            if self.robust is not None
            else self.accumulator.mean(self.factors)
        )
        for name, (delta, trained) in means.items():
            if name in self.factors:
                weights[name] = torch.where(trained, weights[name] - delta, weights[name])


@register("fedit")
@dataclass(frozen=True, kw_only=True)
class FedITConfig(LoraBaselineConfig):
    """FedIT: FedAvg of the LoRA factors A and B, each on its own (Zhang et al., 2024)."""

    secure_sum: ClassVar[bool] = True

    def build(self, run: RunConfig, **common: Any) -> FedIT:
        return FedIT(planner=self.planner(run), robust=self.rule(), **common)
