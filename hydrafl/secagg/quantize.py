"""A site's update as a vector over Z_{2^32}, and the sum of n such vectors back as floats.

Layout: the weight part (exact integers: one element, or one per coordinate for masked strategies) followed by
the quantised part, w * delta / max_weight clipped to [-c, c] and mapped by x -> x * Q / (2c) + Q / 2 onto
[0, Q] with stochastic rounding (unbiased: E[q] = the unrounded value; 0 maps exactly to Q / 2). Each site's
rounding moves a coordinate of w * delta by less than max_weight * 2c / Q, so the decoded weighted sum of n
sites is within n * max_weight * 2c / Q of the exact one (`quantisation_bound`) when nothing was clipped. The
sum, less n * Q / 2, is read as a signed 32-bit integer: without noise it lies in [-n Q / 2, n Q / 2], and the
sites' distributed-DP noise (`noise`) may take it anywhere in [-2^31, 2^31).

Metric slots (`encode_metrics`) may follow: two per metric, each site's weighted metric value quantised onto
[0, Q] after clipping it to the metric's documented range, so the coordinator decodes only weighted means.
"""

from __future__ import annotations

import numpy as np

from hydrafl.secagg.params import MODULUS, SecAggError, SecAggParams


def encode(
    delta: np.ndarray, weight: int | np.ndarray, params: SecAggParams, rng: np.random.Generator
) -> np.ndarray:
    """[weight..., quantised w * delta / max_weight] as uint32; `weight` is an integer or one per coordinate."""
    delta = np.asarray(delta, dtype=np.float64).ravel()
    weights = np.asarray(weight).ravel()
    if weights.size not in (1, delta.size):
        raise SecAggError(
            f"weight must be one number or one per coordinate ({delta.size}), got {weights.size}"
        )
    if not np.all(np.isfinite(delta)):
        raise SecAggError("the update has NaN or infinite values")
    check_weights(weights, params)
    return np.concatenate([weights.astype(np.uint32), quantise(delta, weights, params, rng)])


def check_weights(weights: np.ndarray, params: SecAggParams) -> None:
    if (
        np.any(weights < 0)
        or np.any(weights > params.max_weight)
        or np.any(weights != np.round(weights))
    ):
        raise SecAggError(
            f"weights must be integers in [0, max_weight={params.max_weight}] (the run's secagg-max-weight), "
            f"got up to {weights.max():g}"
        )


def quantise(
    delta: np.ndarray, weights: np.ndarray, params: SecAggParams, rng: np.random.Generator
) -> np.ndarray:
    """The quantised part of `encode` of (a window of) a finite float64 update, its weights checked: coordinate
    by coordinate, and `rng` drawn once per coordinate in order, so an update encoded a window at a time gives
    the values of one call."""
    scale = params.quantization_range / (2 * params.clipping_range)
    scaled = (
        np.clip(
            delta * (weights / params.max_weight), -params.clipping_range, params.clipping_range
        )
        * scale
    )
    scaled += params.quantization_range / 2
    floor = np.floor(scaled)
    quantised = floor + (rng.random(scaled.shape) < scaled - floor)
    return quantised.astype(np.uint32)


def decode_sum(
    total: np.ndarray, num_sites: int, params: SecAggParams, *, per_coordinate: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(weight sum, sum of w * delta) from the field sum of `num_sites` encoded vectors."""
    total = np.asarray(total, dtype=np.uint32)
    width = (total.size // 2) if per_coordinate else 1
    if total.size < width + 1 or (per_coordinate and total.size % 2):
        raise SecAggError(f"a summed vector of {total.size} elements does not fit the layout")
    return total[:width].astype(np.int64), decode_values(total[width:], num_sites, params)


def decode_values(quantised: np.ndarray, num_sites: int, params: SecAggParams) -> np.ndarray:
    """The sum of w * delta from (a window of) the quantised part of the field sum of `num_sites` vectors:
    coordinate by coordinate, so a sum larger than memory is decoded a window at a time to the same bits."""
    if num_sites < 1 or num_sites * params.quantization_range >= MODULUS:
        raise SecAggError(
            f"cannot decode a sum of {num_sites} sites with quantization_range {params.quantization_range}"
        )
    scale = params.quantization_range / (2 * params.clipping_range)
    centred = (
        (quantised - np.uint32(num_sites * params.quantization_range // 2))
        .view(np.int32)
        .astype(np.float64)
    )
    centred /= scale  # in place: the bits of `centred / scale * max_weight`, in one window's memory
    centred *= params.max_weight
    return centred


def quantisation_bound(num_sites: int, params: SecAggParams) -> float:
    """The most rounding can move one coordinate of the decoded weighted sum (unclipped inputs)."""
    return num_sites * params.max_weight * 2 * params.clipping_range / params.quantization_range


METRIC_SLOTS = 2
"""Elements one metric takes at the end of an encoded vector: the weight of the sites that reported it, and its
weighted value."""


def encode_metrics(
    values: list[float | None],
    weight: int,
    ranges: list[float],
    params: SecAggParams,
    rng: np.random.Generator,
) -> np.ndarray:
    """A site's metrics as slots appended to its encoded vector, so the coordinator decodes only their weighted
    sums (`decode_metrics`). Per metric i: [w, w / max_weight * clip(v_i, 0, R_i) * Q / R_i], the second
    stochastically rounded (unbiased) onto [0, Q] like every other coordinate, so n sites' sum stays below
    n Q < 2^32. Values below 0 count as 0 and values above R_i as R_i; a missing or non-finite value sends
    [0, 0] (the site is left out of that metric's mean)."""
    if len(values) != len(ranges):
        raise SecAggError(f"{len(values)} metric values for {len(ranges)} metric slots")
    if not (0 <= weight <= params.max_weight) or weight != int(weight):
        raise SecAggError(
            f"the metrics' weight must be an integer in [0, max_weight={params.max_weight}], got {weight}"
        )
    slots = np.zeros(METRIC_SLOTS * len(values), dtype=np.uint32)
    for i, (value, limit) in enumerate(zip(values, ranges, strict=True)):
        if value is None or not np.isfinite(value):
            continue
        scaled = (
            weight
            / params.max_weight
            * min(max(float(value), 0.0), limit)
            * params.quantization_range
            / limit
        )
        floor = np.floor(scaled)
        slots[METRIC_SLOTS * i] = int(weight)
        slots[METRIC_SLOTS * i + 1] = int(floor + (rng.random() < scaled - floor))
    return slots


def decode_metrics(
    slots: np.ndarray, ranges: list[float], params: SecAggParams
) -> list[tuple[float | None, int]]:
    """Per metric, (the weighted mean of what the summed sites reported (None when none did), their weight)."""
    slots = np.asarray(slots, dtype=np.uint32).astype(np.int64)
    if slots.size != METRIC_SLOTS * len(ranges):
        raise SecAggError(f"{slots.size} metric slots for {len(ranges)} metrics")
    out = []
    for i, limit in enumerate(ranges):
        weight, value = int(slots[METRIC_SLOTS * i]), int(slots[METRIC_SLOTS * i + 1])
        out.append(
            (
                value * limit / params.quantization_range * params.max_weight / weight
                if weight
                else None,
                weight,
            )
        )
    return out


def metric_bound(num_sites: int, limit: float, params: SecAggParams, total_weight: int) -> float:
    """The most rounding can move a decoded metric mean (values inside [0, limit]): each site's rounding moves
    its weighted value by less than one step, max_weight * limit / Q."""
    return num_sites * params.max_weight * limit / params.quantization_range / total_weight
