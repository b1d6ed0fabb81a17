"""A site's update as a vector over Z_{2^32}, and the sum of n such vectors back as floats.

Layout: the weight part (exact integers: one element, or one per coordinate for masked strategies) followed by
the quantised part, w * delta / max_weight clipped to [-c, c] and mapped by x -> x * Q / (2c) + Q / 2 onto
[0, Q] with stochastic rounding (unbiased: E[q] = the unrounded value; 0 maps exactly to Q / 2). Each site's
rounding moves a coordinate of w * delta by less than max_weight * 2c / Q, so the decoded weighted sum of n
sites is within n * max_weight * 2c / Q of the exact one (`quantisation_bound`) when nothing was clipped. The
sum, less n * Q / 2, is read as a signed 32-bit integer: without noise it lies in [-n Q / 2, n Q / 2], and the
sites' distributed-DP noise (`noise`) may take it anywhere in [-2^31, 2^31).
"""

from __future__ import annotations

import numpy as np

from hydrafl.secagg.params import MODULUS, SecAggError, SecAggParams


def encode(delta: np.ndarray, weight: int | np.ndarray, params: SecAggParams, rng: np.random.Generator) -> np.ndarray:
    """[weight..., quantised w * delta / max_weight] as uint32; `weight` is an integer or one per coordinate."""
    delta = np.asarray(delta, dtype=np.float64).ravel()
    weights = np.asarray(weight).ravel()
    if weights.size not in (1, delta.size):
        raise SecAggError(f"weight must be one number or one per coordinate ({delta.size}), got {weights.size}")
    if not np.all(np.isfinite(delta)):
        raise SecAggError("the update has NaN or infinite values")
    if np.any(weights < 0) or np.any(weights > params.max_weight) or np.any(weights != np.round(weights)):
        raise SecAggError(
            f"weights must be integers in [0, max_weight={params.max_weight}] (the run's secagg-max-weight), "
            f"got up to {weights.max():g}"
        )
    scale = params.quantization_range / (2 * params.clipping_range)
    scaled = np.clip(delta * (weights / params.max_weight), -params.clipping_range, params.clipping_range) * scale
    scaled += params.quantization_range / 2
    floor = np.floor(scaled)
    quantised = floor + (rng.random(scaled.shape) < scaled - floor)
    return np.concatenate([weights.astype(np.uint32), quantised.astype(np.uint32)])


def decode_sum(total: np.ndarray, num_sites: int, params: SecAggParams, *, per_coordinate: bool) -> tuple[np.ndarray, np.ndarray]:
    """(weight sum, sum of w * delta) from the field sum of `num_sites` encoded vectors."""
    total = np.asarray(total, dtype=np.uint32)
    if num_sites < 1 or num_sites * params.quantization_range >= MODULUS:
        raise SecAggError(f"cannot decode a sum of {num_sites} sites with quantization_range {params.quantization_range}")
    width = (total.size // 2) if per_coordinate else 1
    if total.size < width + 1 or (per_coordinate and total.size % 2):
        raise SecAggError(f"a summed vector of {total.size} elements does not fit the layout")
    weights = total[:width].astype(np.int64)
    scale = params.quantization_range / (2 * params.clipping_range)
    centred = (total[width:] - np.uint32(num_sites * params.quantization_range // 2)).view(np.int32).astype(np.float64)
    return weights, centred / scale * params.max_weight


def quantisation_bound(num_sites: int, params: SecAggParams) -> float:
    """The most rounding can move one coordinate of the decoded weighted sum (unclipped inputs)."""
    return num_sites * params.max_weight * 2 * params.clipping_range / params.quantization_range
