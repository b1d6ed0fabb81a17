"""Checks on a site's training reply, done once at the boundary before anything is aggregated."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import ArrayRecord, Message


class InvalidUpdate(ValueError):
    """A reply that must not be aggregated; the message says which array or field is wrong."""


def check_train_reply(
    reply: Message,
    global_arrays: ArrayRecord,
    weighted_by_key: str = "num-examples",
    *,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> None:
    """Raise InvalidUpdate unless the reply holds one delta ArrayRecord over known coordinates with the
    global shapes (or, for a site that trained a subnetwork, the `shapes` of its slices) and dtypes, finite
    values, and one MetricRecord with a positive weight."""
    content = reply.content
    if len(content.array_records) != 1 or len(content.metric_records) != 1:
        raise InvalidUpdate(
            f"expected one ArrayRecord and one MetricRecord, got {len(content.array_records)} and "
            f"{len(content.metric_records)}"
        )
    delta = next(iter(content.array_records.values()))
    metrics = next(iter(content.metric_records.values()))
    weight = metrics.get(weighted_by_key)
    if not isinstance(weight, (int, float)) or weight <= 0:
        raise InvalidUpdate(f"metric {weighted_by_key!r} must be a positive number, got {weight!r}")
    for name, array in delta.items():
        if name not in global_arrays:
            raise InvalidUpdate(f"array {name!r} is not a coordinate of the global model")
        expected = global_arrays[name]
        shape = tuple(expected.shape) if shapes is None else shapes.get(name)
        if shape is None:
            raise InvalidUpdate(f"array {name!r} is outside the subnetwork the site was assigned")
        if tuple(array.shape) != tuple(shape) or array.dtype != expected.dtype:
            raise InvalidUpdate(
                f"array {name!r} has shape {tuple(array.shape)} dtype {array.dtype}, expected "
                f"{tuple(shape)} dtype {expected.dtype}"
            )
        if not np.isfinite(array.numpy()).all():
            raise InvalidUpdate(f"array {name!r} contains NaN or Inf")
