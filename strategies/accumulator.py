"""Streaming aggregation: replies are folded into running sums one at a time.

Memory stays O(model) whatever the number of sites, and sums are done in place with torch (no
per-site temporaries), which is what lets one coordinator aggregate many large updates.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from hydrafl.arrays import array_view


class AggregationError(ValueError):
    """Replies cannot be combined (no successful reply, or a reply of the wrong shape)."""


class WeightedDeltaAccumulator:
    """Running sum_k w_k * delta_k and sum_k w_k over the replies seen so far."""

    def __init__(self, weighted_by_key: str = "num-examples") -> None:
        self.weighted_by_key = weighted_by_key
        self.sums: dict[str, torch.Tensor] = {}
        self.total_weight = 0.0
        self.metric_records: list[RecordDict] = []

    def add(self, reply: Message) -> None:
        # Records are picked by type from content.items(): RecordDict's array_records/metric_records views
        # build a reference cycle that keeps every consumed reply alive until the cycle collector runs.
        records = list(reply.content.values())
        arrays = _only([r for r in records if isinstance(r, ArrayRecord)], "ArrayRecord", reply)
        metrics = _only([r for r in records if isinstance(r, MetricRecord)], "MetricRecord", reply)
        weight = float(metrics[self.weighted_by_key])
        if weight <= 0:
            raise AggregationError(f"reply from node {reply.metadata.src_node_id} has {self.weighted_by_key}={weight}")
        for name, array in arrays.items():
            with warnings.catch_warnings():  # a read-only view: only ever read, never written
                warnings.simplefilter("ignore", UserWarning)
                delta = torch.from_numpy(array_view(array))
            if name not in self.sums:
                self.sums[name] = delta.to(torch.float32).mul(weight)
            elif self.sums[name].shape != delta.shape:
                raise AggregationError(f"array {name!r} has shape {tuple(delta.shape)}, expected {tuple(self.sums[name].shape)}")
            else:
                self.sums[name].add_(delta, alpha=weight)
        self.total_weight += weight
        self.metric_records.append(RecordDict({"metrics": metrics}))

    def add_all(self, replies: Iterable[Message]) -> None:
        for reply in replies:
            if not reply.has_error():
                self.add(reply)

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean, computed in place: the accumulator is spent afterwards."""
        if not self.total_weight:
            raise AggregationError("no successful reply to aggregate")
        return {name: total.div_(self.total_weight) for name, total in self.sums.items()}


def _only(records: list, kind: str, reply: Message) -> ArrayRecord | MetricRecord:
    if len(records) != 1:
        raise AggregationError(
            f"reply from node {reply.metadata.src_node_id} must hold exactly one {kind}, found {len(records)}"
        )
    return records[0]
