"""Per-round diagnostics of the sites' pseudo-gradients (delta = start weights - end weights of a round, as
sites send them; both diagnostics are the same for the opposite sign).

They check the replica-scaling claim (whitening inner optimizers scale best with more sites):

- `noise_scale`: B_pg = tr(Cov[delta_site]) / ||mean delta||^2, the pseudo-gradient analogue of the gradient
  noise scale. The mean is sample-weighted (the FedAvg mean). The covariance estimator is chosen by `estimator`:

  * "unbiased" (default): the reliability-weighted unbiased estimator
    sum_i w_i ||d_i - m||^2 / (V1 - V2 / V1), V1 = sum_i w_i, V2 = sum_i w_i^2; with equal weights this is the
    usual 1 / (n - 1) sample covariance. It needs two or more sites with positive weight.
  * "weighted": the weighted population covariance sum_i w_i ||d_i - m||^2 / V1 (1 / n with equal weights);
    zero for a single site.

  A zero mean delta with a nonzero spread gives `math.inf` (no signal, only noise); all-zero spread and mean
  (0 / 0) raise `ZeroDeltaError`.
- `cosine_to_reference`: cosine between the averaged delta and the full-data (pooled) delta, all tensors
  flattened together. A zero vector has no direction: `ZeroDeltaError`.
- `DeltaMoments`: the same B_pg and mean, streamed one delta at a time (a coordinator sees replies one by one
  and keeps no per-site copies): it holds sum w_i, sum w_i^2, sum w_i ||d_i||^2 and sum w_i d_i, and uses
  sum w_i ||d_i - m||^2 = sum w_i ||d_i||^2 - V1 ||m||^2 (clamped at 0 against rounding).

Everything is computed in float64 on CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
import torch

__all__ = ["DeltaMoments", "ZeroDeltaError", "cosine_to_reference", "mean_delta", "noise_scale"]

Delta = Mapping[str, torch.Tensor]
ArrayLike = torch.Tensor | np.ndarray


class ZeroDeltaError(ValueError):
    """A quantity is undefined because a delta (or the mean delta and the spread) is exactly zero."""


def _flatten(
    delta: Delta, names: Sequence[str], shapes: Mapping[str, torch.Size], what: str
) -> torch.Tensor:
    if set(delta) != set(names):
        missing, extra = sorted(set(names) - set(delta)), sorted(set(delta) - set(names))
        raise KeyError(f"{what} has different tensors: missing {missing[:5]}, extra {extra[:5]}")
    parts = []
    for name in names:
        tensor = delta[name]
        if tensor.shape != shapes[name]:
            raise ValueError(
                f"{what}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}"
            )
        parts.append(tensor.detach().to("cpu", torch.float64).reshape(-1))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _stack(deltas: Sequence[Delta]) -> tuple[torch.Tensor, list[str], dict[str, torch.Size]]:
    """[sites, P] float64, with the tensor names (sorted) and shapes of the first delta."""
    if not deltas:
        raise ValueError("no deltas: pass one delta per site")
    names = sorted(deltas[0])
    shapes = {name: deltas[0][name].shape for name in names}
    rows = [_flatten(delta, names, shapes, f"delta {i}") for i, delta in enumerate(deltas)]
    return torch.stack(rows), names, shapes


def _weights(weights: Sequence[float] | torch.Tensor | None, n: int) -> torch.Tensor:
    w = (
        torch.ones(n, dtype=torch.float64)
        if weights is None
        else torch.as_tensor(weights, dtype=torch.float64)
    )
    if w.shape != (n,):
        raise ValueError(
            f"{w.numel()} weights for {n} deltas; pass one weight (e.g. sample count) per site"
        )
    if not torch.isfinite(w).all() or (w < 0).any() or float(w.sum()) <= 0:
        raise ValueError(f"weights must be finite, non-negative and not all zero; got {w.tolist()}")
    return w


def mean_delta(
    deltas: Sequence[Delta], weights: Sequence[float] | torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The sample-weighted mean delta (FedAvg's), per tensor, float64; `weights=None` weighs sites equally."""
    stacked, names, shapes = _stack(deltas)
    w = _weights(weights, len(deltas))
    flat = (w[:, None] * stacked).sum(0) / w.sum()
    out, offset = {}, 0
    for name in names:
        size = shapes[name].numel()
        out[name] = flat[offset : offset + size].reshape(shapes[name])
        offset += size
    return out


def _trace_over_signal(spread: float, v1: float, v2: float, signal: float, estimator: str) -> float:
    """B_pg from the weighted spread sum_i w_i ||d_i - m||^2, V1, V2 and ||m||^2."""
    if estimator not in ("unbiased", "weighted"):
        raise ValueError(f"unknown estimator {estimator!r}; choose 'unbiased' or 'weighted'")
    if estimator == "weighted":
        trace = spread / v1
    else:
        denominator = v1 - v2 / v1
        if denominator <= 0:
            raise ValueError(
                "the unbiased covariance needs at least two sites with positive weight; "
                "use estimator='weighted' for a single site"
            )
        trace = spread / denominator
    if signal == 0.0:
        if trace == 0.0:
            raise ZeroDeltaError("every delta is zero: the noise scale 0 / 0 is undefined")
        return math.inf
    return trace / signal


def _float64(value: ArrayLike) -> torch.Tensor:
    if isinstance(
        value, np.ndarray
    ):  # possibly a read-only view of wire bytes: copy while converting
        return torch.from_numpy(np.array(value, dtype=np.float64))
    return value.detach().to("cpu", torch.float64)


class DeltaMoments:
    """Streaming weighted moments of the sites' deltas: O(model) memory whatever the number of sites."""

    def __init__(self) -> None:
        self.v1 = 0.0  # sum w_i
        self.v2 = 0.0  # sum w_i^2
        self.weighted_sq_norms = 0.0  # sum w_i ||d_i||^2
        self.weighted_sum: dict[str, torch.Tensor] = {}  # sum w_i d_i, float64
        self.count = 0

    def add(self, delta: Mapping[str, ArrayLike], weight: float) -> None:
        """Fold in one site's delta with its weight (e.g. its sample count)."""
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"weight {weight} must be finite and >= 0")
        tensors = {name: _float64(value) for name, value in delta.items()}
        if self.count and set(tensors) != set(self.weighted_sum):
            missing, extra = (
                sorted(set(self.weighted_sum) - set(tensors)),
                sorted(set(tensors) - set(self.weighted_sum)),
            )
            raise KeyError(
                f"delta {self.count} has different tensors: missing {missing[:5]}, extra {extra[:5]}"
            )
        for name, tensor in tensors.items():
            if self.count and tensor.shape != self.weighted_sum[name].shape:
                raise ValueError(
                    f"delta {self.count}: {name} has shape {tuple(tensor.shape)}, "
                    f"expected {tuple(self.weighted_sum[name].shape)}"
                )
            if name in self.weighted_sum:
                self.weighted_sum[name].add_(tensor, alpha=weight)
            else:
                self.weighted_sum[name] = tensor * weight
        self.weighted_sq_norms += weight * sum(float(t.pow(2).sum()) for t in tensors.values())
        self.v1 += weight
        self.v2 += weight * weight
        self.count += 1

    def mean(self) -> dict[str, torch.Tensor]:
        """The weighted mean delta (FedAvg's), float64."""
        if self.v1 <= 0:
            raise ValueError("no delta with a positive weight was added")
        return {name: total / self.v1 for name, total in self.weighted_sum.items()}

    def noise_scale(self, *, estimator: str = "unbiased") -> float:
        """B_pg of the deltas added so far; equal to `noise_scale(deltas, weights)` up to rounding."""
        mean = self.mean()
        signal = sum(float(t.pow(2).sum()) for t in mean.values())
        spread = max(0.0, self.weighted_sq_norms - self.v1 * signal)
        return _trace_over_signal(spread, self.v1, self.v2, signal, estimator)


def noise_scale(
    deltas: Sequence[Delta],
    weights: Sequence[float] | torch.Tensor | None = None,
    *,
    estimator: str = "unbiased",
) -> float:
    """B_pg = tr(Cov[delta_site]) / ||weighted mean delta||^2; see the module docstring for the estimators."""
    if estimator not in ("unbiased", "weighted"):
        raise ValueError(f"unknown estimator {estimator!r}; choose 'unbiased' or 'weighted'")
    stacked, _, _ = _stack(deltas)
    w = _weights(weights, len(deltas))
    v1 = w.sum()
    mean = (w[:, None] * stacked).sum(0) / v1
    spread = float((w * (stacked - mean).pow(2).sum(1)).sum())
    return _trace_over_signal(
        spread, float(v1), float(w.pow(2).sum()), float(mean.pow(2).sum()), estimator
    )


def cosine_to_reference(mean_delta: Delta, reference_delta: Delta) -> float:
    """Cosine between the averaged delta and the full-data delta, over all tensors flattened together."""
    names = sorted(reference_delta)
    shapes = {name: reference_delta[name].shape for name in names}
    a = _flatten(mean_delta, names, shapes, "mean delta")
    b = _flatten(reference_delta, names, shapes, "reference delta")
    norm_a, norm_b = float(a.norm()), float(b.norm())
    if norm_a == 0.0 or norm_b == 0.0:
        which = "mean delta" if norm_a == 0.0 else "reference delta"
        raise ZeroDeltaError(
            f"the {which} is zero, so it has no direction to compare; the cosine is undefined"
        )
    return max(-1.0, min(1.0, float(a @ b) / (norm_a * norm_b)))
