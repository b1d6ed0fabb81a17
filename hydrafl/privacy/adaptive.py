"""Adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive Clipping", NeurIPS 2021),
as Flower's `DifferentialPrivacyServerSideAdaptiveClipping`: after each round the bound C moves geometrically
towards the target quantile of the sites' update norms, C <- C exp(-lr (b - quantile)), where b is the
fraction of updates inside C counted with Gaussian noise of std sigma_b. That count is a release too; the
model's noise multiplier is lowered to z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2 so the two together cost what
z alone would, and the accountant uses the configured z."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hydrafl.privacy.clipping import add_gaussian_


def model_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """z_delta = (z^-2 - (2 sigma_b)^-2)^-1/2: the model's share of the budget of z (Andrew et al., Thm 1)."""
    if noise_multiplier <= 0 or count_stddev <= 0:
        raise ValueError(
            "adaptive clipping needs a noise multiplier > 0 and a clipped-count noise std > 0"
        )
    share = noise_multiplier**-2 - (2 * count_stddev) ** -2
    if share <= 0:
        raise ValueError(
            f"noise multiplier {noise_multiplier} is too small for adaptive clipping with clipped-count noise std "
            f"{count_stddev} (needs z < 2 sigma_b); lower the noise multiplier or raise the count noise"
        )
    return share**-0.5


@dataclass(slots=True)
class AdaptiveClip:
    """The clipping bound and its update rule; `count_stddev` defaults to Andrew et al.'s expected sites / 20."""

    clip: float
    count_stddev: float
    target_quantile: float = 0.5
    lr: float = 0.2
    inside: int = 0
    """Updates of this round whose norm was within the bound."""
    seen: int = 0
    """Updates of this round."""

    def observe(self, norm: float) -> None:
        self.inside += int(norm <= self.clip)
        self.seen += 1

    def end_round(self, generator: torch.Generator) -> float:
        """Move the bound with this round's noised clipped fraction; returns the new bound."""
        if self.seen:
            count = add_gaussian_(
                torch.tensor(float(self.inside), dtype=torch.float64), self.count_stddev, generator
            )
            fraction = float(count) / self.seen
            self.clip *= math.exp(-self.lr * (fraction - self.target_quantile))
        self.inside = self.seen = 0
        return self.clip
