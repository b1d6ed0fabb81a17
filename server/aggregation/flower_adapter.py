"""Flower's contract, in one place: the round driver calls every strategy through `FlowerAdapter`, which gives
a strategy written to Flower's API what Flower's own `Strategy.start` would.

- Weights, not deltas: sites reply with deltas (start - end); a strategy that does not declare
  `consumes_deltas` (Flower's built-ins) is handed each site's end weights instead. They are computed in
  memory from the round's start, decoded once a round, and handed over as `HeldArray`s: serialised, they
  would cost an encode and a decode per reply for nothing but the strategy's reading them back.
- A majority of matching replies: Flower's built-in aggregation (FedAvg and its family) refuses a whole round
  when any reply is laid out differently (metric names, array names), so before it runs, the replies are cut
  to the largest group that agrees and the others fail alone. Which hooks are Flower's own is read from the
  module that wrote them.
- The weight key: a FedAvg's `weighted_by_key`, else hydrafl's `protocol.WEIGHT`.

hydrafl's own strategies take the deltas as they arrive (a stream) and pass through unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Strategy

from hydrafl import protocol
from hydrafl.arrays import HeldArray, array_view
from hydrafl.strategies import hooks
from hydrafl.strategies.accumulator import AggregationError
from hydrafl.strategies.by_tensor import (
    MODEL,
    AggregatesByTensor,
    RoundFiles,
    SumsByTensor,
    follows_its_rule,
    read_ahead,
    sums_follow_their_rule,
)
from hydrafl.tensor_files import as_record, layout_of
from hydrafl.updates import array_names, consistent_majority, metric_layout

log = logging.getLogger(__name__)

COORDINATE_WISE = (
    FedAvg.aggregate_train,
    FedMedian.aggregate_train,
    FedTrimmedAvg.aggregate_train,
)
"""Flower's aggregations whose every tensor depends only on that tensor of each reply (FedProx's is FedAvg's)."""


def flower_wrote(method: Callable[..., Any]) -> bool:
    """Whether Flower's own code implements `method` (a strategy's bound hook), not a subclass's override."""
    return getattr(method, "__func__", method).__module__.startswith("flwr.")


class FlowerAdapter:
    """`strategy`'s aggregation hooks as the round driver calls them, fed as the strategy expects."""

    def __init__(self, strategy: Strategy) -> None:
        self.strategy = strategy
        self.weighted_by_key: str = (
            strategy.weighted_by_key if isinstance(strategy, FedAvg) else protocol.WEIGHT
        )
        self.takes_weights = not (
            isinstance(strategy, hooks.ConsumesDeltas) and strategy.consumes_deltas
        )
        self.matches_train = flower_wrote(strategy.aggregate_train)
        """Flower's aggregate_train: it needs the round's replies together, cut to a matching majority."""
        self.matches_evaluate = flower_wrote(strategy.aggregate_evaluate)
        self.aggregates_by_tensor = follows_its_rule(strategy) or (
            type(strategy).aggregate_train in COORDINATE_WISE
        )
        """The strategy can aggregate a model kept on disk, one tensor at a time (`aggregate_by_tensor`)."""

    def matching(self, server_round: int, replies: list[Message], *, train: bool) -> list[Message]:
        """The replies Flower's aggregation takes: those whose metric names (and, for training, array names)
        agree with most others; all of them for a hook Flower did not write."""
        if not (self.matches_train if train else self.matches_evaluate):
            return replies

        def layout(reply: Message) -> tuple:
            return (metric_layout(reply), array_names(reply) if train else ())

        kept, dropped = consistent_majority(replies, layout)
        for reply in dropped:
            log.warning(
                "round %d: site %d failed: its reply's metric or array names differ from the other sites'",
                server_round,
                reply.metadata.src_node_id,
            )
        return kept

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message], start: ArrayRecord, *, summed: bool
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The strategy's new model and train metrics from `replies` (deltas from `start`); `summed`: the one
        reply of a secure round holds per-coordinate sums (`hooks.TakesSecureSums`)."""
        if summed and isinstance(self.strategy, hooks.TakesSecureSums):
            return self.strategy.aggregate_summed(server_round, replies)
        if not self.takes_weights:
            return self.strategy.aggregate_train(server_round, replies)
        arrays, metrics = self.strategy.aggregate_train(server_round, _as_weights(replies, start))
        return (None if arrays is None else _released(arrays)), metrics

    def by_tensor_refusal(self, arrays: ArrayRecord, *, summed: bool = False) -> str:
        """Why the strategy cannot aggregate `arrays` kept on disk ("" when it can); `summed`: from a secure
        round's sums."""
        if (
            summed
            and isinstance(self.strategy, hooks.TakesSecureSums)
            and not sums_follow_their_rule(self.strategy)
        ):
            return (
                f"secure aggregation decodes {type(self.strategy).__name__}'s per-coordinate sums in "
                "memory; those that step on them tensor by tensor: Hydra and the width baselines"
            )
        if not self.aggregates_by_tensor:
            return (
                f"strategy {type(self.strategy).__name__} needs every reply in memory at once; those that "
                "aggregate tensor by tensor: FedAvg, FedProx, FedMedian, FedTrimmedAvg, DiLoCo, Hydra and "
                "the width baselines. Raise resident-model-mb above the model if this coordinator can "
                "hold every reply"
            )
        if isinstance(self.strategy, AggregatesByTensor):
            return self.strategy.by_tensor_refusal(arrays)
        return ""

    def aggregate_by_tensor(
        self,
        server_round: int,
        replies: Sequence[Message],
        start: ArrayRecord,
        files: RoundFiles,
        *,
        summed: bool,
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """`aggregate_train` (with `summed`, as there) of a model on disk: the strategy's own by-tensor
        aggregation, or, for Flower's coordinate-wise rules, their `aggregate_train` on each tensor's cut of the
        replies in turn; refused (`AggregationError`) where `by_tensor_refusal` says so."""
        if refusal := self.by_tensor_refusal(start, summed=summed):
            raise AggregationError(refusal)
        replies = [reply for reply in replies if not reply.has_error()]
        if not replies:
            return None, None
        if summed and isinstance(self.strategy, hooks.TakesSecureSums):
            assert isinstance(self.strategy, SumsByTensor)  # by_tensor_refusal checked it
            return self.strategy.aggregate_summed_by_tensor(server_round, replies, start, files)
        if follows_its_rule(self.strategy):
            assert isinstance(self.strategy, AggregatesByTensor)
            return self.strategy.aggregate_by_tensor(server_round, replies, start, files)
        model = files.writer(MODEL, layout_of(start))
        metrics = None
        for name, array, cut in read_ahead(start, replies):
            if not cut:
                model.write(name, array)
                continue
            arrays, metrics = self.aggregate_train(
                server_round, cut, as_record({name: array}), summed=False
            )
            if arrays is None:
                model.discard()
                return None, None
            model.write(name, arrays[name].numpy().astype(array.dtype, copy=False))
        return as_record(model.close()), metrics

    def aggregate_evaluate(
        self, server_round: int, replies: Sequence[Message]
    ) -> MetricRecord | None:
        return self.strategy.aggregate_evaluate(server_round, replies)


def _as_weights(replies: Iterable[Message], start: ArrayRecord) -> Iterator[Message]:
    """Each reply with its delta (its first ArrayRecord) replaced by the site's end weights, start - delta in
    the start's dtypes. The start is decoded once for the round; each delta is read in place."""
    start_values: dict[str, np.ndarray] = {}
    for reply in replies:
        key, deltas = next(
            (key, record)
            for key, record in reply.content.items()
            if isinstance(record, ArrayRecord)
        )
        weights = (
            ArrayRecord()
        )  # filled item by item: ArrayRecord(dict) would copy each into a plain Array
        for name, delta in deltas.items():
            if name not in start_values:
                start_values[name] = start[name].numpy()
            values = start_values[name] - array_view(delta)
            weights[name] = HeldArray(values.astype(start_values[name].dtype, copy=False))
        reply.content[key] = weights
        yield reply


def _released(arrays: ArrayRecord) -> ArrayRecord:
    """The strategy's new model as plain Arrays: a strategy that returns a reply's own weights (one site's, as
    a selection rule may) gets them serialised here, so no HeldArray outlives the aggregation."""
    if not any(isinstance(array, HeldArray) for array in arrays.values()):
        return arrays
    return ArrayRecord(
        {
            name: Array(array.dtype, array.shape, array.stype, array.data)
            if isinstance(array, HeldArray)
            else array
            for name, array in arrays.items()
        }
    )
