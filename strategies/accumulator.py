"""Streaming aggregation: replies are folded into running sums one at a time.

Memory stays O(model) whatever the number of sites, and sums are done in place with torch (no
per-site temporaries), which is what lets one coordinator aggregate many large updates.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from hydrafl.arrays import array_view
from hydrafl.subnet.slices import Slice
from hydrafl.updates import records

if TYPE_CHECKING:
    from hydrafl.privacy.central import CentralDp


class AggregationError(ValueError):
    """Replies cannot be combined (no successful reply, or a reply of the wrong shape)."""


class WeightedDeltaAccumulator:
    """Running sum_k w_k * delta_k and sum_k w_k over the replies seen so far. With central DP (`dp`) every
    reply is clipped and weighs 1, and the mean gets the mechanism's noise."""

    def __init__(self, weighted_by_key: str = "num-examples", *, dp: CentralDp | None = None) -> None:
        self.weighted_by_key = weighted_by_key
        self.dp = dp
        self.sums: dict[str, torch.Tensor] = {}
        self.total_weight = 0.0
        self.metric_records: list[RecordDict] = []

    def add(self, reply: Message) -> None:
        arrays, metrics, weight = _parse(reply, self.weighted_by_key)
        deltas = {name: _view(array) for name, array in arrays.items()}
        if self.dp is not None:
            weight = self.dp.clip_factor(deltas)  # counted once, at most C
        for name, delta in deltas.items():
            if name not in self.sums:
                self.sums[name] = delta.to(torch.float32).mul(weight)
            elif self.sums[name].shape != delta.shape:
                raise AggregationError(f"array {name!r} has shape {tuple(delta.shape)}, expected {tuple(self.sums[name].shape)}")
            else:
                self.sums[name].add_(delta, alpha=weight)
        self.total_weight += weight if self.dp is None else 1.0
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_all(self, replies: Iterable[Message]) -> None:
        for reply in replies:
            if not reply.has_error():
                self.add(reply)

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean, computed in place: the accumulator is spent afterwards."""
        if not self.total_weight:
            raise AggregationError("no successful reply to aggregate")
        mean = {name: total.div_(self.total_weight) for name, total in self.sums.items()}
        if self.dp is not None:
            for tensor in mean.values():
                self.dp.noise_(tensor, self.total_weight)
            self.dp.end_round()
        return mean


class MaskedDeltaAccumulator:
    """Per-coordinate running sums for subnetwork updates: sum_k w_k m_k delta_k and sum_k w_k m_k, where
    m_k is the 0/1 mask of the coordinates site k was assigned (a site's values outside it are ignored). With
    central DP (`dp`) every reply is clipped and weighs 1, and coordinate k's mean gets noise z C / n_k."""

    def __init__(self, weighted_by_key: str = "num-examples", *, dp: CentralDp | None = None) -> None:
        self.weighted_by_key = weighted_by_key
        self.dp = dp
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, torch.Tensor] = {}
        self.metric_records: list[RecordDict] = []

    def add(self, reply: Message, masks: Mapping[str, torch.Tensor]) -> None:
        """Fold in one reply; `masks` (bool, full shape) are the coordinates its site was assigned."""
        arrays, metrics, weight = _parse(reply, self.weighted_by_key)
        unassigned = sorted(set(arrays.keys()) - set(masks))
        if unassigned:
            raise AggregationError(
                f"reply from node {reply.metadata.src_node_id} updates {unassigned[:3]}, outside its subnetwork"
            )
        deltas = {name: _view(array) for name, array in arrays.items()}
        for name, delta in deltas.items():
            if delta.shape != masks[name].shape:
                raise AggregationError(f"array {name!r} has shape {tuple(delta.shape)}, expected {tuple(masks[name].shape)}")
        counted = weight
        if self.dp is not None:  # clipped over its assigned coordinates, counted once
            weight = self.dp.clip_factor({name: delta * masks[name] for name, delta in deltas.items()})
            counted = 1.0
        for name, delta in deltas.items():
            mask = masks[name].to(torch.float32)
            if name not in self.sums:
                self.sums[name] = torch.zeros(mask.shape, dtype=torch.float32)
                self.weights[name] = torch.zeros(mask.shape, dtype=torch.float32)
            self.sums[name].addcmul_(mask * weight, delta)
            self.weights[name].add_(mask, alpha=counted)
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_slices(
        self, reply: Message, slices: Mapping[str, Slice], shapes: Mapping[str, tuple[int, ...]], *, count_once: bool = False
    ) -> None:
        """Fold in one reply that carries only its subnetwork's slices (compact tensors of `Slice.take`'s shape),
        straight into the full-shape sums. `count_once`: every site weighs 1 instead of its weight (the plain
        mean over the sites that trained a coordinate). Every shape is checked before anything is added."""
        arrays, metrics, weight = _parse(reply, self.weighted_by_key)
        node = reply.metadata.src_node_id
        unassigned = sorted(set(arrays.keys()) - set(slices))
        if unassigned:
            raise AggregationError(f"reply from node {node} updates {unassigned[:3]}, outside its subnetwork")
        deltas = {name: _view(array) for name, array in arrays.items()}
        for name, delta in deltas.items():
            expected = slices[name].taken_shape(shapes[name])
            if tuple(delta.shape) != expected:
                raise AggregationError(
                    f"reply from node {node}: array {name!r} has shape {tuple(delta.shape)}, its slice is {expected}"
                )
        weight = 1.0 if count_once else weight
        if self.dp is not None:
            weight = self.dp.clip_factor(deltas)
        counted = 1.0 if self.dp is not None else weight
        for name, delta in deltas.items():
            if name not in self.sums:
                self.sums[name] = torch.zeros(shapes[name], dtype=torch.float32)
                self.weights[name] = torch.zeros(shapes[name], dtype=torch.float32)
            slices[name].add_to(self.sums[name], delta, alpha=weight)
            slices[name].add_to(self.weights[name], torch.ones(delta.shape), alpha=counted)
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_sums(self, reply: Message) -> None:
        """Fold in pre-summed replies (secure aggregation): one reply holding ArrayRecords `sums` and `weights`
        of full shapes, and the metrics."""
        metrics = _only(records(reply.content, MetricRecord), "MetricRecord", reply)
        sums, weights = reply.content["sums"], reply.content["weights"]
        for name, array in sums.items():
            total, weight = _view(array).to(torch.float32), _view(weights[name]).to(torch.float32)
            if total.shape != weight.shape:
                raise AggregationError(f"array {name!r}: sums of shape {tuple(total.shape)}, weights {tuple(weight.shape)}")
            self.sums[name] = self.sums[name].add_(total) if name in self.sums else total.clone()
            self.weights[name] = self.weights[name].add_(weight) if name in self.weights else weight.clone()
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def mean(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per name: (masked weighted mean delta, 0 where no site trained; bool mask of trained coordinates).
        Computed in place: the accumulator is spent afterwards."""
        if not self.metric_records:
            raise AggregationError("no successful reply to aggregate")
        out = {}
        for name, total in self.sums.items():
            covered = self.weights[name] > 0
            out[name] = (total.div_(self.weights[name].clamp(min=1e-30)).mul_(covered), covered)
            if self.dp is not None:
                self.dp.noise_(out[name][0], self.weights[name])
        if self.dp is not None:
            self.dp.end_round()
        return out


def _parse(reply: Message, weighted_by_key: str) -> tuple[ArrayRecord, MetricRecord, float]:
    arrays = _only(records(reply.content, ArrayRecord), "ArrayRecord", reply)  # `records`: why not Flower's views
    metrics = _only(records(reply.content, MetricRecord), "MetricRecord", reply)
    weight = float(metrics[weighted_by_key])
    if weight <= 0:
        raise AggregationError(f"reply from node {reply.metadata.src_node_id} has {weighted_by_key}={weight}")
    return arrays, metrics, weight


def _view(array: Array) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only view: only ever read, never written
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array_view(array))


def _only(records: list, kind: str, reply: Message) -> ArrayRecord | MetricRecord:
    if len(records) != 1:
        raise AggregationError(
            f"reply from node {reply.metadata.src_node_id} must hold exactly one {kind}, found {len(records)}"
        )
    return records[0]
