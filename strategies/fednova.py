"""FedNova (Wang et al., "Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization", NeurIPS 2020), as Flower's baselines run it with plain local SGD: site i takes tau_i local steps
and reports them (`fednova_site.py`); the coordinator averages the normalised updates d_i = delta_i / tau_i
with p_i = n_i / sum n and steps by tau_eff = sum p_i tau_i:

    x <- x - lr_g tau_eff sum_i p_i d_i

With equal tau_i this is FedAvg; with unequal ones, a site that took more steps no longer pulls the model
towards its own optimum in proportion. Each site's tau_i weighs its own update, so FedNova refuses secure
aggregation and central DP (`secure_sum` off); compression and a site policy apply to the delta as for FedAvg.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.fednova_site import LOCAL_STEPS
from hydrafl.strategies.registry import StrategyConfig, register
from hydrafl.updates import records
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig

log = logging.getLogger(__name__)


class FedNova(FedAvg):
    """FedAvg's sampling and evaluation; replies carry deltas (start - end) and their local steps."""

    consumes_deltas = True

    def __init__(self, *, server_lr: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server_lr = server_lr
        self.current_arrays: ArrayRecord | None = None

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current_arrays is None:
            return None, None
        normalised: dict[str, torch.Tensor] = {}
        total_weight, weighted_steps, metric_records = 0.0, 0.0, []
        for reply in replies:
            if reply.has_error():
                continue
            metrics = records(reply.content, MetricRecord)[0]
            steps = metrics.get(LOCAL_STEPS)
            if not isinstance(steps, (int, float)) or not 1 <= steps < math.inf:
                log.warning(
                    "round %d: site %d's reply has no local steps: left out",
                    server_round,
                    reply.metadata.src_node_id,
                )
                continue
            weight = float(metrics[self.weighted_by_key])  # type: ignore[arg-type]
            for name, delta in from_record(records(reply.content, ArrayRecord)[0]).items():
                normalised[name] = normalised.get(name, 0) + (weight / steps) * delta.double()
            total_weight += weight
            weighted_steps += weight * steps
            metric_records.append(RecordDict({"metrics": metrics}))
        if not total_weight:
            return None, None
        tau_eff = weighted_steps / total_weight
        scale = self.server_lr * tau_eff / total_weight
        updated = {
            name: (w - scale * normalised[name]).to(w.dtype) if name in normalised else w
            for name, w in from_record(self.current_arrays).items()
        }
        metrics = self.train_metrics_aggr_fn(metric_records, self.weighted_by_key)
        return to_record(updated), metrics

    def state_dict(self) -> dict[str, Any]:
        return {}  # stateless across rounds: the model is the checkpoint's

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


@register("fednova")
@dataclass(frozen=True, kw_only=True)
class FedNovaConfig(StrategyConfig):
    """FedNova: each site's update normalised by its local steps, then scaled by their mean (Wang et al., 2020)."""

    fednova_epochs: float = 0.0
    """Local epochs per round, so each site's steps follow its data size (0: every site takes --local-steps)."""
    fednova_server_lr: float = 1.0
    """Global step size on the normalised average."""

    def __post_init__(self) -> None:
        check(self.fednova_epochs >= 0, "fednova-epochs", self.fednova_epochs, ">= 0")
        check(self.fednova_server_lr > 0, "fednova-server-lr", self.fednova_server_lr, "> 0")

    def build(self, run: RunConfig, **common: Any) -> FedNova:
        return FedNova(server_lr=self.fednova_server_lr, **common)
