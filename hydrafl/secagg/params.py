"""The protocol's parameters (Flower's SecAgg+ defaults) and its one error."""

from __future__ import annotations

import math
from dataclasses import dataclass

PURPOSES = ("train", "evaluate")
"""What a secure round sums (`SecAggParams.purpose`)."""
MODULUS = 1 << 32
"""Every masked vector lives in Z_{2^32}: uint32 arithmetic wraps exactly there."""


class SecAggError(ValueError):
    """A secure-aggregation message is malformed or out of turn, or too few sites remain; nothing was changed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SecAggParams:
    num_shares: int = 0
    """Sites each site shares its secrets with, itself included (a ring of neighbours); 0 = every site."""
    reconstruction_threshold: int = 0
    """Shares that rebuild a secret; 0 = a majority of `num_shares` (at least 2). Above half the shares, or a
    coordinator could ask two disjoint groups of sites for the two secrets that unmask one site."""
    clipping_range: float = 8.0
    """Each coordinate of w * delta / max_weight is clipped to [-clipping_range, clipping_range]."""
    quantization_range: int = 1 << 22
    """Levels of the quantiser; n sites need n * quantization_range < 2^32."""
    max_weight: int = 1000
    """A site's weight (num-examples) above this is refused: it scales the update into the clipping range."""
    dp_clip: float = 0.0
    """Distributed DP (`noise`): each site clips its whole update to this L2 norm and weighs 1; 0 = off."""
    dp_noise_multiplier: float = 0.0
    """Distributed DP: the survivors' noise shares sum to std z * dp_clip (slightly more: `noise`) per coordinate."""
    site_clip: float = 0.0
    """Honest-site bound (`--secagg-clip`): each site clips its whole update to this L2 norm before encoding and
    masking; 0 = off. Enforced by the sites, not checked by anyone: a modified site skips it (no range proofs)."""
    purpose: str = "train"
    """What the round's sum is for: "train" (the update and train metrics) or "evaluate" (evaluation metrics
    only). It is part of every signature of the round, so a signature given in one never counts in the other."""

    def __post_init__(self) -> None:
        _require(
            self.num_shares == 0 or self.num_shares >= 2,
            f"num_shares must be 0 (all) or >= 2, got {self.num_shares}",
        )
        _require(
            self.reconstruction_threshold == 0 or self.reconstruction_threshold >= 2,
            f"reconstruction_threshold must be 0 (majority) or >= 2, got {self.reconstruction_threshold}",
        )
        _require(self.clipping_range > 0, f"clipping_range must be > 0, got {self.clipping_range}")
        _require(
            2 <= self.quantization_range < MODULUS and self.quantization_range % 2 == 0,
            f"quantization_range must be an even integer in [2, 2^32), got {self.quantization_range}",
        )
        _require(self.max_weight >= 1, f"max_weight must be >= 1, got {self.max_weight}")
        _require(
            math.isfinite(self.dp_clip) and self.dp_clip >= 0,
            f"dp_clip must be a number >= 0, got {self.dp_clip}",
        )
        _require(
            math.isfinite(self.dp_noise_multiplier)
            and self.dp_noise_multiplier >= 0
            and (self.dp_clip > 0 or not self.dp_noise_multiplier),
            f"dp_noise_multiplier must be a number >= 0, and 0 without dp_clip, got {self.dp_noise_multiplier}",
        )
        _require(
            math.isfinite(self.site_clip) and self.site_clip >= 0,
            f"site_clip must be a number >= 0, got {self.site_clip}",
        )
        _require(
            self.purpose in PURPOSES, f"purpose must be one of {PURPOSES}, got {self.purpose!r}"
        )

    def shares(self, num_sites: int) -> int:
        """Shares per secret in a round of `num_sites` sites (the neighbourhood size, itself included)."""
        return num_sites if self.num_shares == 0 else min(self.num_shares, num_sites)

    def threshold(self, num_sites: int) -> int:
        """Shares needed to rebuild a secret in a round of `num_sites` sites."""
        if self.reconstruction_threshold:
            return self.reconstruction_threshold
        return max(2, self.shares(num_sites) // 2 + 1)

    def check_round(self, num_sites: int) -> None:
        """Raise SecAggError when a round of `num_sites` sites cannot run with these parameters."""
        shares, threshold = self.shares(num_sites), self.threshold(num_sites)
        _require(num_sites >= 2, f"secure aggregation needs at least 2 sites, got {num_sites}")
        _require(
            threshold <= shares,
            f"reconstruction_threshold {threshold} exceeds the {shares} shares each secret is split into",
        )
        _require(
            2 * threshold
            > shares,  # else two disjoint groups could each rebuild a different secret of one site
            f"reconstruction_threshold {threshold} must be above half the {shares} shares each secret is split into",
        )
        _require(
            shares == num_sites or shares % 2 == 1,
            f"num_shares {shares} below the {num_sites} sites must be odd (a ring of equal sides)",
        )
        _require(
            num_sites * self.quantization_range < MODULUS,
            f"{num_sites} sites x quantization_range {self.quantization_range} would wrap the 2^32 field",
        )

    def to_config(self) -> dict[str, int | float]:
        return {field: getattr(self, field) for field in self.__slots__}

    @classmethod
    def from_config(cls, config: dict) -> SecAggParams:
        try:
            return cls(
                **{field: type(getattr(cls(), field))(config[field]) for field in cls.__slots__}
            )
        except (KeyError, TypeError, ValueError) as error:
            raise SecAggError(f"bad secure-aggregation parameters {config!r}: {error}") from None


def neighbours(participants: tuple[int, ...], node: int, shares: int) -> tuple[int, ...]:
    """`node`'s neighbourhood on the ring of `participants` (sorted), itself included: `shares` nodes, the
    ones nearest it on either side."""
    index = participants.index(node)
    count = len(participants)
    if shares >= count:
        return participants
    half = (shares - 1) // 2  # odd `shares` (check_round): the relation is symmetric
    chosen = {participants[(index + offset) % count] for offset in range(-half, half + 1)}
    return tuple(p for p in participants if p in chosen)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SecAggError(message)
