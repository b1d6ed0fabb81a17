"""DiLoCo: sites send pseudo-gradients after H inner steps; the coordinator averages them and applies an
outer SGD step with Nesterov (or heavy-ball) momentum, in torch.optim.SGD's convention.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator


class DiLoCo(FedAvg):
    """FedAvg's sampling and evaluation, with an outer optimizer over streamed pseudo-gradients.

    Replies carry deltas (start - end weights). With outer_lr=1 and momentum=0 this is exactly FedAvg of the
    sites' end weights.
    """

    consumes_deltas = True

    def __init__(self, *, outer_lr: float = 0.7, momentum: float = 0.9, nesterov: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if outer_lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(f"DiLoCo needs outer_lr > 0 and 0 <= momentum < 1, got {outer_lr=}, {momentum=}")
        self.outer_lr = outer_lr
        self.momentum = momentum
        self.nesterov = nesterov
        self.current_arrays: ArrayRecord | None = None
        self.momentum_buffer: dict[str, torch.Tensor] = {}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
        accumulator.add_all(replies)
        if not accumulator.total_weight or self.current_arrays is None:
            return None, None
        pseudo_gradient = accumulator.mean()
        updated = {
            name: weights - self.outer_lr * self._direction(name, pseudo_gradient[name])
            if name in pseudo_gradient
            else weights
            for name, weights in from_record(self.current_arrays).items()
        }
        metrics = self.train_metrics_aggr_fn(accumulator.metric_records, self.weighted_by_key)
        return to_record(updated), metrics

    def _direction(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """torch.optim.SGD: b = mu b + d; step along d + mu b (Nesterov) or b (heavy ball)."""
        if not self.momentum:
            return delta
        buffer = self.momentum_buffer.get(name)
        buffer = delta.clone() if buffer is None else buffer.mul_(self.momentum).add_(delta)
        self.momentum_buffer[name] = buffer
        return delta + self.momentum * buffer if self.nesterov else buffer

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum_buffer": {name: t.clone() for name, t in self.momentum_buffer.items()},
            "current_arrays": self.current_arrays,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum_buffer = {name: t.clone() for name, t in state["momentum_buffer"].items()}
        self.current_arrays = state["current_arrays"]
