"""DiLoCo: sites send pseudo-gradients after H inner steps; the coordinator averages them and applies an
outer SGD step with Nesterov (or heavy-ball) momentum, in torch.optim.SGD's convention.

Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.accumulator import WeightedDeltaAccumulator
from hydrafl.strategies.by_tensor import RoundFiles, clip_factors, delta_of, metric_contents
from hydrafl.strategies.outer import OuterOptimizer, step_by_tensor
from hydrafl.strategies.parallel_fold import FoldPool
from hydrafl.strategies.registry import StrategyConfig, register
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig
    from hydrafl.privacy.central import CentralDp


class DiLoCo(FedAvg):
    """FedAvg's sampling and evaluation, with an outer optimizer over streamed pseudo-gradients.

    Replies carry deltas (start - end weights). With outer_lr=1 and momentum=0 this is exactly FedAvg of the
    sites' end weights.
    """

    consumes_deltas = True

    def __init__(self, config: OuterConfig | None = None, **kwargs: Any) -> None:
        """`config`: the outer optimizer's knobs (default: DiLoCo's); `kwargs`: FedAvg's sampling."""
        super().__init__(**kwargs)
        config = config or DiLoCoConfig()
        self.outer = OuterOptimizer(
            lr=config.outer_lr, momentum=config.outer_momentum, nesterov=config.outer_nesterov
        )
        self.current_arrays: ArrayRecord | None = None
        self.central_dp: CentralDp | None = None
        """Central DP on the mean pseudo-gradient (`hydrafl.privacy.central.with_central_dp` sets it)."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key, dp=self.central_dp)
        accumulator.add_all(replies)
        if not accumulator.total_weight or self.current_arrays is None:
            return None, None
        pseudo_gradient = accumulator.mean()
        updated = {
            name: self.outer.step(name, weights, pseudo_gradient[name])
            if name in pseudo_gradient
            else weights
            for name, weights in from_record(self.current_arrays).items()
        }
        metrics = self.train_metrics_aggr_fn(accumulator.metric_records, self.weighted_by_key)
        return to_record(updated), metrics

    def by_tensor_refusal(self, arrays: ArrayRecord) -> str:
        return ""

    def aggregate_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_train` one tensor at a time (`by_tensor`): the same sums and outer step per tensor, the
        model and the momentum each written to a file of their own."""
        stepped = dict.fromkeys(name for reply in replies for name in delta_of(reply)[1])
        pool = FoldPool()
        dp = self.central_dp
        factors = None if dp is None else clip_factors(replies, dp, pool)  # by node

        def step(name: str, array: Array, cut: list[Message]) -> torch.Tensor:
            accumulator = WeightedDeltaAccumulator(self.weighted_by_key, threads=pool.threads)
            if dp is None or factors is None:
                accumulator.add_all(cut)
                return self.outer.step_(name, _tensor(array), accumulator.mean()[name])
            for reply in cut:  # clipped by the factor of the whole reply, each counted once
                delta = _tensor(delta_of(reply)[1][name])
                accumulator.add_weighted({name: delta}, factors[reply.metadata.src_node_id])
            mean = accumulator.mean()[name]
            dp.noise_(mean, accumulator.total_weight)
            return self.outer.step_(name, _tensor(array), mean)

        order = [*stepped, *(name for name in start if name not in stepped)]  # the noise's order
        self.current_arrays = step_by_tensor(self.outer, start, replies, files, step, order)
        if dp is not None:
            dp.end_round()
        contents = metric_contents(replies)
        return self.current_arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def state_dict(self) -> dict[str, Any]:
        dp = self.central_dp.state_dict() if self.central_dp else {}
        return {**self.outer.state_dict(), **dp, "current_arrays": self.current_arrays}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state)
        if self.central_dp:
            self.central_dp.load_state_dict(state)
        self.current_arrays = state["current_arrays"]


def _tensor(array: Array) -> torch.Tensor:
    return torch.from_numpy(array.numpy())


@dataclass(frozen=True, kw_only=True)
class OuterConfig(StrategyConfig):
    """The outer optimizer's knobs: SGD with (Nesterov) momentum over the mean pseudo-gradient."""

    outer_lr: float = 0.7
    """Outer learning rate."""
    outer_momentum: float = 0.9
    """Outer momentum."""
    outer_nesterov: bool = True
    """Nesterov momentum (else heavy ball)."""

    def __post_init__(self) -> None:
        check(0 <= self.outer_momentum < 1, "outer-momentum", self.outer_momentum, "0 <= mu < 1")


@register("diloco")
@dataclass(frozen=True, kw_only=True)
class DiLoCoConfig(OuterConfig):
    """DiLoCo: the mean pseudo-gradient takes an outer SGD step with Nesterov momentum (Douillard et al., 2023)."""

    probes_curvature: ClassVar[bool] = True
    secure_sum: ClassVar[bool] = True

    outer_check: bool = True
    """Probe the sites' curvature before round 1 and warn when the outer step is predicted unstable; off
    saves sending the model to every site once more (a model of many GiB)."""

    def checks_stability(self) -> bool:
        return self.outer_check

    def build(self, run: RunConfig, **common: Any) -> DiLoCo:
        return DiLoCo(self, **common)
