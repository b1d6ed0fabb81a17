"""Checks on a site's reply, done once at the boundary before anything is aggregated, in every runtime (the
coordinator checks the wire form of a reply too, before it accepts it): one reply that Flower's aggregation
would choke on must fail that site, never the round."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TypeVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from hydrafl.arrays import array_view
from hydrafl.bounded import bounded, quoted
from hydrafl.tensor_files import OnDiskArray

MAX_WEIGHT = 1e15
"""A reply's example count above this is not a count (and sums of such weights overflow)."""

R = TypeVar("R", ArrayRecord, MetricRecord, ConfigRecord)


def records(content: RecordDict, kind: type[R]) -> list[R]:
    """The records of one type in a message's content, picked from `content.values()`. Flower's typed views
    (`content.array_records` and the like) form a reference cycle that keeps the whole content, arrays included,
    alive until the cycle collector runs: a server reading them would hold every reply it has seen."""
    return [record for record in content.values() if isinstance(record, kind)]


REPLY_ARRAYS = "reply-arrays"
"""Train message key: the ArrayRecords a reply carries beside its delta, as the run's strategy declares them (its
site half's `reply_arrays`, written by its coordinator half); the coordinator's transport reads it from the
message it stored, never from the reply."""


def declared_reply_arrays(content: RecordDict) -> tuple[str, ...]:
    """The ArrayRecords a reply to a message of this `content` carries beside its delta (REPLY_ARRAYS)."""
    for record in records(content, ConfigRecord):
        if REPLY_ARRAYS in record:
            return tuple(str(name) for name in record[REPLY_ARRAYS])  # type: ignore[union-attr]
    return ()


class InvalidUpdate(ValueError):
    """A reply that must not be aggregated; the message says which array or field is wrong."""


def check_train_reply(
    reply: Message,
    global_arrays: ArrayRecord,
    weighted_by_key: str = "num-examples",
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    extra_arrays: Sequence[str] = (),
) -> None:
    """Raise InvalidUpdate unless the reply holds one delta ArrayRecord over known coordinates with the
    global shapes (or, for a site that trained a subnetwork, the `shapes` of its slices) and dtypes, finite
    values, and one MetricRecord of finite numbers with a positive weight. Beside the delta, first, it holds
    exactly the ArrayRecords `extra_arrays` names (what the run's strategy's site half declares, e.g. SCAFFOLD's
    control variate change), each held to the delta's rules."""
    arrays = [(key, r) for key, r in reply.content.items() if isinstance(r, ArrayRecord)]
    metrics = records(reply.content, MetricRecord)
    keys = [key for key, _ in arrays]
    if len(metrics) != 1 or len(arrays) != 1 + len(extra_arrays):
        raise InvalidUpdate(
            f"expected {1 + len(extra_arrays)} ArrayRecord(s) and one MetricRecord, got {len(arrays)} and "
            f"{len(metrics)}"
        )
    if keys[0] in extra_arrays or sorted(keys[1:]) != sorted(extra_arrays):
        names = ", ".join(quoted(key) for key in keys)
        raise InvalidUpdate(
            f"expected the delta then ArrayRecords {list(extra_arrays)}, got {bounded(names, 300)}"
        )
    check_metrics(metrics[0], weighted_by_key)
    for _, record in arrays:
        _check_delta(record, global_arrays, shapes)


def _check_delta(
    delta: ArrayRecord,
    global_arrays: ArrayRecord,
    shapes: Mapping[str, tuple[int, ...]] | None,
) -> None:
    for name, array in delta.items():
        if name not in global_arrays:
            raise InvalidUpdate(f"array {quoted(name)} is not a coordinate of the global model")
        expected = global_arrays[name]
        shape = tuple(expected.shape) if shapes is None else shapes.get(name)
        if shape is None:
            raise InvalidUpdate(
                f"array {quoted(name)} is outside the subnetwork the site was assigned"
            )
        if isinstance(
            array, OnDiskArray
        ):  # its layout is what its storage holds, read only if unchecked
            found, dtype = tuple(array.shape), np.dtype(array.dtype)
        else:
            try:  # a view, not a copy: the values' own shape (an Array's declared shape is not its bytes')
                values = array_view(array)
            except (ValueError, TypeError, EOFError) as error:
                raise InvalidUpdate(f"array {quoted(name)} is not a NumPy array: {error}") from None
            found, dtype = tuple(values.shape), values.dtype
        if found != tuple(shape) or tuple(array.shape) != tuple(shape) or dtype != expected.dtype:
            raise InvalidUpdate(
                f"array {quoted(name)} has shape {found} dtype {dtype}, expected "
                f"{tuple(shape)} dtype {expected.dtype}"
            )
        if isinstance(array, OnDiskArray) and array.checked_finite:
            continue
        if not np.isfinite(array_view(array)).all():
            raise InvalidUpdate(f"array {quoted(name)} contains NaN or Inf")


def check_evaluate_reply(reply: Message, weighted_by_key: str = "num-examples") -> None:
    """Raise InvalidUpdate unless the reply holds exactly one MetricRecord of finite numbers with a positive
    weight, and no arrays."""
    arrays, metrics = records(reply.content, ArrayRecord), records(reply.content, MetricRecord)
    if arrays or len(metrics) != 1:
        raise InvalidUpdate(
            f"expected one MetricRecord and no arrays, got {len(metrics)} and {len(arrays)} ArrayRecords"
        )
    check_metrics(metrics[0], weighted_by_key)


def check_metrics(metrics: MetricRecord, weighted_by_key: str | None) -> None:
    """Finite numbers only, and (unless `weighted_by_key` is None) a weight that is a positive count."""
    for name, value in metrics.items():
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, (int, float)) and math.isfinite(v) for v in values):
            raise InvalidUpdate(f"metric {quoted(name)} is not a finite number")
    if weighted_by_key is None:
        return
    weight = metrics.get(weighted_by_key)
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not 0 < weight <= MAX_WEIGHT
    ):
        raise InvalidUpdate(
            f"metric {quoted(weighted_by_key)} must be a number in (0, {MAX_WEIGHT:g}], got {bounded(repr(weight), 80)}"
        )


def metric_layout(reply: Message) -> tuple[tuple[str, int], ...]:
    """The names of a reply's metrics and the length of each list-valued one (-1 for a number)."""
    metrics = records(reply.content, MetricRecord)[0]
    return tuple(
        sorted((name, len(v) if isinstance(v, list) else -1) for name, v in metrics.items())
    )


def array_names(reply: Message) -> tuple[str, ...]:
    return tuple(sorted(records(reply.content, ArrayRecord)[0].keys()))


def consistent_majority(
    replies: Sequence[Message], layout: Callable[[Message], Hashable]
) -> tuple[list[Message], list[Message]]:
    """Flower's aggregation refuses a round whose replies differ in layout (metric keys, array names); keep the
    largest group of replies that agree (ties: the group of the lowest node id), so one site with an odd reply
    fails alone. Returns (kept, dropped), each in the order given."""
    groups: dict[Hashable, list[Message]] = defaultdict(list)
    for reply in replies:
        groups[layout(reply)].append(reply)
    if len(groups) <= 1:
        return list(replies), []
    best = max(
        groups.values(), key=lambda group: (len(group), -min(r.metadata.src_node_id for r in group))
    )
    kept = set(map(id, best))
    return best, [reply for reply in replies if id(reply) not in kept]
