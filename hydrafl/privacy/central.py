"""Central DP on the coordinator: each site's update (all its arrays together) clipped to C, every site counted
once, Gaussian noise of std z C on each coordinate's sum, i.e. z C / n_k on the mean of coordinate k over the
n_k sites that trained it (a subnetwork strategy's masked mean included); every server optimizer then steps on
that noised mean, so what it outputs and keeps is post-processing. hydrafl's streaming strategies hold a
`CentralDp` and hand it to their accumulator; Flower's own mean-based strategies run behind `NoisedMean`, which
hands them the noised mean alone. A strategy whose output is not a post-processing of the noised mean (a median,
a trimmed mean, Krum's selection) is refused."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from flwr.serverapp.strategy import FedAvg, Strategy

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
        self,
        noise_multiplier: float,
        clip: float,
        *,
        adaptive: AdaptiveClip | None = None,
        seed: int | None = None,
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
        """`clip_factor` of an update whose L2 norm the caller computed (the accumulator, block by block). An
        update whose norm overflowed weighs 0: the site still counts once, and the round goes on."""
        if self.adaptive is not None:
            self.adaptive.observe(norm)
        return clip_factor(norm, self.clip) if math.isfinite(norm) else 0.0

    def noise_(self, mean: torch.Tensor, sites: torch.Tensor | float) -> torch.Tensor:
        """Add the noise of one array's mean in place: std z C / n_k where `sites` (n_k, a scalar or per
        coordinate) trained it; coordinates no site trained get none."""
        if self.model_noise_multiplier == 0:
            return mean
        sites = torch.as_tensor(sites, dtype=torch.float64)
        std = torch.where(
            sites > 0, self.model_noise_multiplier * self.clip / sites.clamp(min=1.0), 0.0
        )
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
    """The run's central DP (None when it clips nothing, or under secure aggregation, where the sites clip and
    noise: `hydrafl.secagg.noise`). Adaptive clipping's count noise is Andrew et al.'s sites / 20, raised to z
    where that is less, so any z works at any number of sites (the model's noise is then at most
    2 / sqrt(3) = 1.155 times z C)."""
    if not run.dp_clip or run.secagg:
        return None
    adaptive = None
    if run.dp_adaptive:
        count_stddev = max(run.required_sites / 20, run.dp_noise_multiplier)
        adaptive = AdaptiveClip(clip=run.dp_clip, count_stddev=count_stddev)
    return CentralDp(run.dp_noise_multiplier, run.dp_clip, adaptive=adaptive, seed=seed)


def with_central_dp(strategy: Strategy, run: RunConfig) -> Strategy:
    """`strategy` with the run's central DP: a hydrafl strategy takes it into its own aggregation (it declares
    `central_dp`), a Flower strategy built on the mean runs behind `NoisedMean`; any other is refused. Under
    secure aggregation the strategy is returned as it is: its one reply already holds the noised mean."""
    dp = central_dp(run)
    if dp is None:
        return strategy
    if hasattr(strategy, "central_dp"):
        if getattr(strategy, "lora_products", False) and run.lora_rank:
            raise ConfigError(
                "central DP over LoRA products B A is not supported; set hydra-lora=factors"
            )
        strategy.central_dp = dp
        return strategy
    if (
        isinstance(strategy, FedAvg)
        and type(strategy).__module__.startswith("flwr.")
        and run.options.secure_sum
    ):
        from hydrafl.strategies.noised_mean import NoisedMean

        return NoisedMean(strategy, dp)
    raise ConfigError(
        f"strategy {run.strategy!r} does not support central DP (dp-clip): its output is not a post-processing "
        "of the noised mean of the clipped updates"
    )


def round_clip(strategy: Strategy) -> float | None:
    """The clipping bound `strategy` applies this round (read before it aggregates), None without central DP."""
    dp = getattr(strategy, "central_dp", None)
    return None if dp is None else float(dp.clip)
