"""L2 clipping of a whole update and Gaussian noise: what central DP (the coordinator, on the sum of the
sites' updates) and a site's own policy (local DP, on its reply) both do, so both bound the same quantity."""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping

import torch


def l2_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of all arrays of an update together."""
    return math.sqrt(sum(float(tensor.double().pow(2).sum()) for tensor in update.values()))


def clip_factor(norm: float, bound: float) -> float:
    """The factor that scales an update of L2 norm `norm` to at most `bound` (1 when it is already inside)."""
    if not (math.isfinite(norm) and norm >= 0):
        raise ValueError(f"an update's norm must be finite, got {norm}")
    return min(1.0, bound / norm) if norm > 0 else 1.0


def clip(update: Mapping[str, torch.Tensor], bound: float) -> dict[str, torch.Tensor]:
    """`update` scaled to L2 norm at most `bound` (new tensors; the input is left as it is)."""
    factor = clip_factor(l2_norm(update), bound)
    return {name: tensor.mul(factor) for name, tensor in update.items()}


def noise_generator(seed: int | None = None) -> torch.Generator:
    """A generator for DP noise: seeded only for tests, otherwise from the OS's entropy, so nobody who reads
    the run's configuration can replay (and subtract) the noise."""
    generator = torch.Generator()
    generator.manual_seed(secrets.randbits(63) if seed is None else seed)
    return generator


def add_gaussian_(
    tensor: torch.Tensor, std: torch.Tensor | float, generator: torch.Generator
) -> torch.Tensor:
    """Add N(0, std^2) noise in place, per coordinate (`std` a scalar or a tensor of `tensor`'s shape)."""
    noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float64)
    tensor.add_((noise * std).to(tensor.dtype))
    return tensor
