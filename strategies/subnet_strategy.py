"""What Hydra and the width baselines share: each site is assigned a subnetwork (`SubnetSpec`) from the
planning round, downloads only what its forward pass reads, trains and uploads only its own slices; the
global model takes the masked per-coordinate mean of the deltas (coordinates no site trained keep their value
and momentum) through an outer optimizer. Over LoRA the mean and the step are taken on each module's product
B A, masked to the slices each site ran, and factored back to the run's rank (`lora_factors`).

A strategy subclasses this once and says what a site trains (`assign`); the planning round
(`planner.SitePlanner`), how a spec slices the arrays (`SlicePlan`: by layers and heads, or by width) and the
outer step (`outer.OuterOptimizer`) are components it holds.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from hydrafl.arrays import from_record, sliced_record, to_record
from hydrafl.lora_pairs import lora_pairs
from hydrafl.strategies.accumulator import AggregationError, MaskedDeltaAccumulator
from hydrafl.strategies.by_tensor import RoundFiles, metric_contents, one_tensor_sums
from hydrafl.strategies.lora_factors import (
    MaskedProductAccumulator,
    reply_delta,
    reply_weight,
    svd_factors,
)
from hydrafl.strategies.outer import OuterOptimizer, step_by_tensor
from hydrafl.strategies.planner import BudgetError, SitePlanner
from hydrafl.strategies.robust import MaskedRobustAggregator, RobustRule
from hydrafl.subnet.slices import Slice, layout_slices, read_slices
from hydrafl.subnet.spec import SubnetSpec

if TYPE_CHECKING:
    from hydrafl.privacy.central import CentralDp

log = logging.getLogger(__name__)


class SlicePlan(Protocol):
    """How a spec slices the global arrays (what a site trains and uploads)."""

    def start_round(self, server_round: int, arrays: ArrayRecord) -> None: ...

    def slices(self, spec: SubnetSpec) -> dict[str, Slice]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class LayoutPlan:
    """Slices by layers and heads, from the layout the sites reported in the planning round."""

    def __init__(self, planner: SitePlanner) -> None:
        self.planner = planner

    def start_round(self, server_round: int, arrays: ArrayRecord) -> None:
        pass

    def slices(self, spec: SubnetSpec) -> dict[str, Slice]:
        return layout_slices(self.planner.layout, spec)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class SubnetStrategy(FedAvg):
    """FedAvg's sampling and evaluation, over per-site subnetworks and a masked mean."""

    consumes_deltas = True
    count_once = False
    """True: a coordinate's update is the plain mean over the sites that trained it (each site weighs 1)."""

    def __init__(
        self,
        *,
        planner: SitePlanner | None = None,
        plan: SlicePlan | None = None,
        outer: OuterOptimizer | None = None,
        lora_products: bool = True,
        robust: RobustRule = RobustRule(),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.robust = robust
        """A robust rule (median, trimmed mean) holds the round's replies; the mean streams them."""
        self.planner = planner or SitePlanner()
        self.plan = plan or LayoutPlan(self.planner)
        self.outer = outer or OuterOptimizer(lr=1.0, momentum=0.0, nesterov=True)
        self.lora_products = lora_products
        self.current_arrays: ArrayRecord | None = None
        self.specs: dict[int, SubnetSpec] = {}
        self.trainable_params: dict[int, dict[str, int]] = {}
        """Per round, per site (node id as a string): the coordinates it was assigned to train."""
        self.central_dp: CentralDp | None = None
        """Central DP on the masked mean (`hydrafl.privacy.central.with_central_dp` sets it)."""

    def assign(self, node: int, server_round: int, index: int) -> SubnetSpec:
        """The subnetwork `node` trains this round; it is the `index`-th site assigned one. KeyError: the node
        missed the planning round; BudgetError: nothing fits it."""
        raise NotImplementedError

    def site_slices(self, node: int) -> dict[str, Slice]:
        """The coordinates `node` trains this round: what its reply carries, as compact slices."""
        return self.plan.slices(self.specs[node])

    def configure_query(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        return (
            self.planner.queries(arrays, config, grid.get_node_ids())
            if self.planner.due(server_round)
            else []
        )

    def aggregate_query(self, server_round: int, replies: Iterable[Message]) -> None:
        self.planner.take_replies(replies, self.weighted_by_key)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        self.current_arrays = arrays
        self.plan.start_round(server_round, arrays)
        messages, self.specs, counts = [], {}, {}
        name = type(self).__name__
        for sampled in self.planner.planned(
            super().configure_train(server_round, arrays, config, grid), name
        ):
            node = sampled.metadata.dst_node_id
            try:
                self.specs[node] = spec = self.assign(node, server_round, len(self.specs))
            except BudgetError as error:
                log.warning("%s: site %d cannot train this round: %s", name, node, error)
                continue
            counts[str(node)] = sum(
                sl.numel(arrays[n].shape) for n, sl in self.site_slices(node).items()
            )
            content = RecordDict(
                {
                    "arrays": self.download(node, arrays),
                    "config": ConfigRecord({**config, **spec.to_config()}),
                }
            )
            messages.append(Message(content, dst_node_id=node, message_type=MessageType.TRAIN))
        self.trainable_params[server_round] = counts
        return messages

    def download(self, node: int, arrays: ArrayRecord) -> ArrayRecord:
        """What `node` is sent to train: only the coordinates its subnetwork's forward pass reads
        (`subnet.slices.read_slices`; the site computes the same slices from its model and fills them in)."""
        layers = {name: layer for name, (layer, _, _) in self.planner.layout.items()}
        return sliced_record(arrays, read_slices(self.site_slices(node), layers, self.specs[node]))

    def reply_shapes(self, node: int, arrays: ArrayRecord) -> dict[str, tuple[int, ...]] | None:
        """The shape of each array `node`'s reply may carry (its slices of `arrays`); None: no spec sent."""
        if node not in self.specs:
            return None
        return {
            name: sl.taken_shape(arrays[name].shape) for name, sl in self.site_slices(node).items()
        }

    def aggregate_summed(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Secure aggregation (`hooks.TakesSecureSums`): the masked mean from the sites' per-coordinate sums,
        then the same outer step."""
        if self.current_arrays is None:
            return None, None
        weights = from_record(self.current_arrays)
        if self.lora_products and lora_pairs(weights, required=False):
            raise AggregationError(
                "secure aggregation sums coordinates, not LoRA products B A: use hydra-lora=factors"
            )
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
        for reply in replies:
            accumulator.add_sums(reply)
        for name, (delta, trained) in accumulator.mean().items():
            weights[name] = self.outer.masked_step(name, weights[name], delta, trained)
        return to_record(weights), self.train_metrics_aggr_fn(
            accumulator.metric_records, self.weighted_by_key
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self.current_arrays is None:
            return None, None
        weights = from_record(self.current_arrays)
        shapes = {name: tuple(tensor.shape) for name, tensor in weights.items()}
        accumulator = MaskedDeltaAccumulator(self.weighted_by_key, dp=self.central_dp)
        pairs = lora_pairs(weights, required=False) if self.lora_products else []
        if pairs and self.robust.robust:
            raise AggregationError(
                f"the {self.robust.name} rule is taken coordinate by coordinate, not on LoRA products B A; "
                "over LoRA use it with hydra-lora=factors"
            )
        products = MaskedProductAccumulator(pairs, weights)
        robust = MaskedRobustAggregator(self.robust)
        for reply in replies:
            if not reply.has_error():
                if (node := reply.metadata.src_node_id) not in self.specs:
                    raise AggregationError(
                        f"reply from node {node}, which was assigned no subnetwork this round"
                    )
                slices = self.site_slices(node)
                accumulator.add_slices(
                    reply, slices, shapes, count_once=self.count_once
                )  # checks every shape
                if self.robust.robust:
                    robust.add_slices(reply_delta(reply), slices, shapes)
                if pairs:
                    products.add(
                        reply,
                        slices,
                        1.0 if self.count_once else reply_weight(reply, self.weighted_by_key),
                    )
        if not accumulator.metric_records:
            return None, None
        aggregated = robust.aggregate() if self.robust.robust else accumulator.mean()
        for name, (delta, trained) in aggregated.items():
            if name not in products.factors:
                weights[name] = self.outer.masked_step(name, weights[name], delta, trained)
        product_means = products.mean()
        for pair in pairs:
            if (
                pair.module in product_means
            ):  # B A takes the step, then back to the run's rank; else A, B unchanged
                delta, trained = product_means[pair.module]
                start = products.start_products[pair.module]
                product = self.outer.masked_step(
                    f"{pair.module}.lora-product", start, delta, trained
                )
                if not torch.isfinite(product).all():
                    raise AggregationError(
                        f"the product B A of {pair.module!r} is not finite after the step"
                    )
                weights[pair.b], weights[pair.a] = svd_factors(product, weights[pair.a].shape[0])
        return to_record(weights), self.train_metrics_aggr_fn(
            accumulator.metric_records, self.weighted_by_key
        )

    def by_tensor_refusal(self, arrays: ArrayRecord) -> str:
        if self.central_dp is not None or self.robust.robust:
            return "central DP and the robust rules need whole replies"
        if self.lora_products and lora_pairs(arrays.keys(), required=False):
            return "LoRA products B A are aggregated per module (hydra-lora=factors aggregates by tensor)"
        return ""

    def aggregate_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_train`'s masked mean and outer step one tensor at a time (`by_tensor`), for the plain mean
        on coordinates; the model and the momentum each written to a file of their own."""
        unassigned = [
            r.metadata.src_node_id for r in replies if r.metadata.src_node_id not in self.specs
        ]
        if unassigned:
            raise AggregationError(
                f"reply from node {unassigned[0]}, which was assigned no subnetwork this round"
            )
        slices = {node: self.site_slices(node) for node in self.specs}

        def fold(
            accumulator: MaskedDeltaAccumulator, name: str, reply: Message, shape: tuple[int, ...]
        ) -> None:
            site = slices[reply.metadata.src_node_id]
            if name not in site:
                raise AggregationError(
                    f"reply from node {reply.metadata.src_node_id} updates {name!r}, outside its subnetwork"
                )
            accumulator.add_slices(
                reply, {name: site[name]}, {name: shape}, count_once=self.count_once
            )

        return self._step_by_tensor(replies, start, files, fold)

    def aggregate_summed_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_summed` one tensor at a time (`by_tensor`): each tensor's masked mean from its cut of the
        sums and weights, the same outer step; the model and the momentum each written to a file of their own."""
        return self._step_by_tensor(
            replies,
            start,
            files,
            lambda accumulator, name, reply, _: accumulator.add_sums(one_tensor_sums(reply, name)),
        )

    def _step_by_tensor(
        self,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
        fold: Callable[[MaskedDeltaAccumulator, str, Message, tuple[int, ...]], None],
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Each tensor's masked mean of the replies cut to it (`fold` adds one), then the outer step."""

        def step(name: str, array: Array, cut: list[Message]) -> torch.Tensor:
            accumulator = MaskedDeltaAccumulator(self.weighted_by_key)
            for reply in cut:
                fold(accumulator, name, reply, tuple(array.shape))
            delta, trained = accumulator.mean()[name]
            return self.outer.masked_step(name, torch.from_numpy(array.numpy()), delta, trained)

        self.current_arrays = step_by_tensor(self.outer, start, replies, files, step)
        contents = metric_contents(replies)
        return self.current_arrays, self.train_metrics_aggr_fn(contents, self.weighted_by_key)

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.outer.state_dict(),
            **self.planner.state_dict(),
            **self.plan.state_dict(),
            "current_arrays": self.current_arrays,
            "specs": copy.deepcopy(self.specs),
            "trainable_params": copy.deepcopy(self.trainable_params),
            **(self.central_dp.state_dict() if self.central_dp else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state)
        if self.central_dp:
            self.central_dp.load_state_dict(state)
        self.planner.load_state_dict(state)
        self.plan.load_state_dict(state)
        self.current_arrays = state["current_arrays"]
        self.specs, self.trainable_params = (
            copy.deepcopy(state["specs"]),
            copy.deepcopy(state["trainable_params"]),
        )
