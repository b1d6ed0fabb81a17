"""Central DP for Flower's own strategies, as one mechanism: each site's update clipped to C and counted once,
Gaussian noise of std z C / n on the mean, and then the strategy's server step (FedAvg's, FedAvgM's momentum,
FedAdam's, FedYogi's or FedAdagrad's moments) runs on that noised mean alone, so its output and every state it
keeps are a post-processing of the accounted release.

Flower's DP wrappers do it the other way round (the optimizer steps on the un-noised, example-weighted mean
and noise is added to its output), which is not the mechanism the accountant accounts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from hydrafl.arrays import from_record, to_record
from hydrafl.privacy.central import CentralDp
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.hooks import restore_strategy_state, strategy_state


class NoisedMean(Strategy):
    """`strategy` (FedAvg or a Flower strategy built on its mean) behind `dp`: it is handed one reply, the current
    model plus the noised mean update; the sites' metrics reach it only as their mean."""

    consumes_deltas = True

    def __init__(self, strategy: FedAvg, dp: CentralDp) -> None:
        self.strategy = strategy
        self.central_dp = dp
        self.weighted_by_key: str = strategy.weighted_by_key
        self.current_arrays: ArrayRecord | None = None
        self.template: Message | None = None
        """A train message of the round, which the one reply handed to the strategy answers."""

    def __repr__(self) -> str:
        return f"NoisedMean({self.strategy!r}, z={self.central_dp.noise_multiplier}, C={self.central_dp.clip})"

    def summary(self) -> None:
        self.strategy.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        messages = list(self.strategy.configure_train(server_round, arrays, config, grid))
        self.current_arrays, self.template = arrays, (messages[0] if messages else None)
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key, dp=self.central_dp)
        accumulator.add_all(replies)
        if not accumulator.total_weight or self.current_arrays is None or self.template is None:
            return None, None
        means = self.strategy.train_metrics_aggr_fn(
            accumulator.metric_records, self.weighted_by_key
        )
        metrics = MetricRecord(
            {**dict(means or {}), self.weighted_by_key: int(accumulator.total_weight)}
        )
        noised = accumulator.mean()
        weights = {
            name: current - noised[name].to(current.dtype) if name in noised else current
            for name, current in from_record(self.current_arrays).items()
        }
        content = RecordDict({"arrays": to_record(weights), "metrics": metrics})
        return self.strategy.aggregate_train(
            server_round, [Message(content, reply_to=self.template)]
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return self.strategy.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(
        self, server_round: int, replies: Iterable[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)

    def state_dict(self) -> dict[str, Any]:
        return {"strategy": strategy_state(self.strategy), **self.central_dp.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_strategy_state(self.strategy, state["strategy"])
        self.central_dp.load_state_dict(state)
