"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning", ICML 2020),
as Flower's baselines run it: the coordinator keeps the server control variate c and sends it with the model;
each site corrects its local steps by c - c_i and replies with its delta and the change of its c_i
(`scaffold_site.py`, option II). The coordinator steps x <- x - lr_g mean_w(delta) (sample-weighted, as
FedAvg) and c <- c + (1/N) sum over the replies of the change of c_i, N the sites connected.

Each site's reply is needed (two records, the second averaged over all N sites), so SCAFFOLD refuses secure
aggregation and central DP (`secure_sum` off) and compressed updates; a site policy's clipping and noise apply
to both records, and screening to the delta.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.registry import StrategyConfig, register
from hydrafl.strategies.scaffold_site import CONTROL, ScaffoldSite
from hydrafl.updates import REPLY_ARRAYS, records
from hydrafl.validation import ConfigError, check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class Scaffold(FedAvg):
    """FedAvg's sampling and evaluation; replies carry deltas (start - end) and the change of c_i."""

    consumes_deltas = True
    reply_arrays = ScaffoldSite.reply_arrays

    def __init__(self, *, server_lr: float = 1.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.server_lr = server_lr
        self.control: dict[str, torch.Tensor] = {}
        """The server control variate c (zero until the first aggregation)."""
        self.current_arrays: ArrayRecord | None = None
        self.num_sites = 0
        """N: the sites connected when the round was configured."""

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = arrays
        self.num_sites = len(list(grid.get_node_ids()))
        self.control = self.control or {
            n: torch.zeros_like(t) for n, t in from_record(arrays).items()
        }
        config[REPLY_ARRAYS] = list(self.reply_arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        control = to_record(self.control)
        for message in messages:
            message.content[CONTROL] = control
        return messages

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current_arrays is None:
            return None, None
        delta_sum: dict[str, torch.Tensor] = {}
        control_sum: dict[str, torch.Tensor] = {}
        total_weight, metric_records = 0.0, []
        for reply in replies:
            if reply.has_error():
                continue
            metrics = records(reply.content, MetricRecord)[0]
            weight = float(metrics[self.weighted_by_key])  # type: ignore[arg-type]
            delta = from_record(records(reply.content, ArrayRecord)[0])
            for name, value in delta.items():
                delta_sum[name] = delta_sum.get(name, 0) + weight * value.double()
            for name, value in from_record(reply.content[CONTROL]).items():  # type: ignore[arg-type]
                control_sum[name] = control_sum.get(name, 0) + value.double()
            total_weight += weight
            metric_records.append(RecordDict({"metrics": metrics}))
        if not total_weight:
            return None, None
        current = from_record(self.current_arrays)
        updated = {
            name: (w - self.server_lr * delta_sum[name] / total_weight).to(w.dtype)
            if name in delta_sum
            else w
            for name, w in current.items()
        }
        for name, change in control_sum.items():
            self.control[name] = (self.control[name] + change / self.num_sites).to(torch.float32)
        metrics = self.train_metrics_aggr_fn(metric_records, self.weighted_by_key)
        return to_record(updated), metrics

    def state_dict(self) -> dict[str, Any]:
        return {"control": {n: t.clone() for n, t in self.control.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.control = {n: t.clone() for n, t in state["control"].items()}


@register("scaffold")
@dataclass(frozen=True, kw_only=True)
class ScaffoldConfig(StrategyConfig):
    """SCAFFOLD: local steps corrected by control variates, against client drift (Karimireddy et al., 2020)."""

    site_proximal_term: ClassVar[bool] = True
    scaffold_server_lr: float = 1.0
    """Global step size on the mean delta (1: the sites' weighted mean model)."""

    def __post_init__(self) -> None:
        check(self.scaffold_server_lr > 0, "scaffold-server-lr", self.scaffold_server_lr, "> 0")

    def build(self, run: RunConfig, **common: Any) -> Scaffold:
        if run.compress != "none":
            raise ConfigError(
                f"invalid --compress={run.compress!r}: strategy scaffold sends two records per reply, which "
                "compression does not carry; use --compress none"
            )
        return Scaffold(server_lr=self.scaffold_server_lr, **common)
