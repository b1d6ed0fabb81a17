"""Central DP on the coordinator: each site's update (all its arrays together) clipped to C, every site counted
once, Gaussian noise of std z C on each coordinate's sum, i.e. z C / n_k on the mean of coordinate k over the
n_k sites that trained it (a subnetwork strategy's masked mean included). hydrafl's streaming strategies hold
a `CentralDp` and hand it to their accumulator; Flower's own strategies get Flower's DP wrappers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from flwr.serverapp.strategy import (
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    Strategy,
)

from hydrafl.privacy.adaptive import AdaptiveClip, model_noise_multiplier
from hydrafl.privacy.clipping import add_gaussian_, clip_factor, l2_norm, noise_generator
from hydrafl.validation import ConfigError

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


class CentralDp:
    """One run's clipping bound (fixed, or adaptive) and noise; the accumulator of each round calls it."""

    noise_multiplier: float
    """The configured z: what the accountant accounts."""
    clip: float
    adaptive: AdaptiveClip | None
    generator: torch.Generator

    def __init__(
        self, noise_multiplier: float, clip: float, *, adaptive: AdaptiveClip | None = None, seed: int | None = None
    ) -> None:
        if not (math.isfinite(clip) and clip > 0):
            raise ValueError(f"the clipping bound must be a positive number, got {clip}")
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise ValueError(f"the noise multiplier must be a number >= 0, got {noise_multiplier}")
        self.noise_multiplier = noise_multiplier
        self.clip = clip
        self.adaptive = adaptive
        self.generator = noise_generator(seed)

    @property
    def model_noise_multiplier(self) -> float:
        """The noise multiplier of the model's noise: z, or z_delta with adaptive clipping (its count is noised)."""
        if self.adaptive is None or self.noise_multiplier == 0:
            return self.noise_multiplier
        return model_noise_multiplier(self.noise_multiplier, self.adaptive.count_stddev)

    def round_copy(self) -> CentralDp:
        """This round's bound and model noise without adaptive clipping, for a second accumulator of the same
        replies (a LoRA fold beside the head's): the replies' norms are observed once, by the original."""
        return CentralDp(self.model_noise_multiplier, self.clip)

    def clip_factor(self, update: Mapping[str, torch.Tensor]) -> float:
        """The factor that brings one site's update (all its arrays) within the bound; seen by adaptive clipping."""
        return self.clip_factor_of_norm(l2_norm(update))

    def clip_factor_of_norm(self, norm: float) -> float:
        """`clip_factor` of an update whose L2 norm the caller computed (the accumulator, block by block)."""
        if self.adaptive is not None:
            self.adaptive.observe(norm)
        return clip_factor(norm, self.clip)

    def noise_(self, mean: torch.Tensor, sites: torch.Tensor | float) -> torch.Tensor:
        """Add the noise of one array's mean in place: std z C / n_k where `sites` (n_k, a scalar or per
        coordinate) trained it; coordinates no site trained get none."""
        if self.model_noise_multiplier == 0:
            return mean
        sites = torch.as_tensor(sites, dtype=torch.float64)
        std = torch.where(sites > 0, self.model_noise_multiplier * self.clip / sites.clamp(min=1.0), 0.0)
        return add_gaussian_(mean, std, self.generator)

    def end_round(self) -> None:
        """After the round's noise: an adaptive bound moves towards the target quantile of the norms."""
        if self.adaptive is not None:
            self.clip = self.adaptive.end_round(self.generator)
            self.adaptive.clip = self.clip

    def state_dict(self) -> dict[str, Any]:
        return {"dp_clip": self.clip}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clip = state.get("dp_clip", self.clip)
        if self.adaptive is not None:
            self.adaptive.clip = self.clip


def central_dp(run: RunConfig, *, seed: int | None = None) -> CentralDp | None:
    """The run's central DP (None when it clips nothing); adaptive clipping's count noise is sites / 20."""
    if not run.dp_clip:
        return None
    adaptive = None
    if run.dp_adaptive:
        count_stddev = run.required_sites / 20 if run.dp_noise_multiplier else 0.0
        adaptive = AdaptiveClip(clip=run.dp_clip, count_stddev=count_stddev)
    dp = CentralDp(run.dp_noise_multiplier, run.dp_clip, adaptive=adaptive, seed=seed)
    try:
        _ = dp.model_noise_multiplier
    except ValueError as error:
        raise ConfigError(f"invalid dp-noise-multiplier={run.dp_noise_multiplier!r}: {error}") from None
    return dp


def with_central_dp(strategy: Strategy, run: RunConfig) -> Strategy:
    """`strategy` with the run's central DP: a hydrafl strategy takes it into its own aggregation (it declares
    `central_dp`), a Flower strategy is wrapped in Flower's server-side DP wrapper, whose noise std is
    z C / min_sites (conservative: a round has at least that many replies)."""
    dp = central_dp(run)
    if dp is None:
        return strategy
    if hasattr(strategy, "central_dp"):
        if getattr(strategy, "lora_products", False) and run.lora_rank:
            raise ConfigError("central DP over LoRA products B A is not supported; set hydra-lora=factors")
        strategy.central_dp = dp
        return strategy
    if not type(strategy).__module__.startswith("flwr."):
        raise ConfigError(
            f"strategy {run.strategy!r} does not support central DP (dp-clip); it works with Flower's strategies, "
            "diloco, the subnetwork strategies (hydra, heterofl, fjord, fedrolex) and fedit"
        )
    if run.dp_adaptive:
        try:
            return DifferentialPrivacyServerSideAdaptiveClipping(
                strategy, run.dp_noise_multiplier, run.required_sites, initial_clipping_norm=run.dp_clip
            )
        except ValueError as error:
            raise ConfigError(f"invalid dp-noise-multiplier={run.dp_noise_multiplier!r}: {error}") from None
    return DifferentialPrivacyServerSideFixedClipping(strategy, run.dp_noise_multiplier, run.dp_clip, run.required_sites)


def round_clip(strategy: Strategy) -> float | None:
    """The clipping bound `strategy` applies this round (read before it aggregates), None without central DP."""
    if isinstance(strategy, (DifferentialPrivacyServerSideFixedClipping, DifferentialPrivacyServerSideAdaptiveClipping)):
        return float(strategy.clipping_norm)
    dp = getattr(strategy, "central_dp", None)
    return None if dp is None else float(dp.clip)
