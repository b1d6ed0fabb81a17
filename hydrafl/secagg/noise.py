"""Distributed DP under secure aggregation: each site clips its whole update to L2 norm C, weighs 1, rounds it
onto the quantiser's lattice and adds its share of Skellam noise before masking, so the coordinator only ever
decodes a noised sum (Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated
Learning", NeurIPS 2021).

Noise: Skellam of variance mu is Poisson(mu / 2) - Poisson(mu / 2), integer valued, and a sum of independent
Skellams is Skellam with the variances added. Each of the n sites a round sends to adds variance
(z C~ / gamma)^2 / n per coordinate, so the k that survive sum to one Skellam of variance (k / n) (z C~ / gamma)^2.

Subnetworks (Hydra-nets, the width and rank baselines): a site uploads its slices at full shape (0 elsewhere)
with a 0/1 weight per coordinate, clipped to C over its slices, weighing 1. Its share goes on every coordinate,
not only on those it covers, so each coordinate of the sum holds (k / n) (z C~ / gamma)^2 whether n_l = 1 or n
sites cover it, and the coordinator's masked mean (sum / n_l) has std z C~ / n_l with every site surviving:
central DP's. Shares scaled to 1 / n_l on covered coordinates only would give the same with no dropout, but a
dropout would cost the least-covered coordinates most (one of n_l = 2 leaves half their noise), and the epsilon
sent ahead would have to assume the worst coverage; with shares on every coordinate every coordinate keeps
k / n, the same z_eff as a whole-model round, and a sparse layer's noise does not rest on its few sites.

Rounding: the lattice step is gamma = 2 clipping_range / quantization_range. Stochastic rounding moves each
coordinate by less than one step, so a rounded update's L2 norm is below C / gamma + sqrt(d) steps: the
sensitivity uses that worst case, C~ = C + gamma sqrt(d) (simpler than Kairouz et al.'s conditional rounding,
and at gamma = 16 / 2^22 it adds 0.4% to C = 1 at d = 10^6), and the noise is calibrated to C~.

Accounting (replace-one): L2 sensitivity D2 = 2 C~ / gamma, L1 sensitivity D1 <= sqrt(d) D2. Agarwal et al.'s
Theorem 3.5 bounds the Skellam's RDP at integer orders alpha > 1 by
    alpha D2^2 / (2 mu) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 mu^2), 3 D1 / (2 mu)),
and for alpha >= 2, (2 alpha - 1) D2^2 + 6 D1 <= alpha (2 D2^2 + 3 D1), so it is at most alpha r^2 / 2 with
r^2 = D2^2 / mu + (2 D2^2 + 3 D1) / (2 mu^2): a Gaussian mechanism's RDP at every integer order. The round is
accounted as that Gaussian, noise multiplier z_eff = 2 / r, at integer orders only
(`hydrafl.privacy.accountant.distributed_epsilon`); without the second term z_eff = z sqrt(k / n).

Wrap-around: the decoded sum is read as a signed 32-bit integer (`quantize.decode_sum`); `check_range` refuses a
round whose sum could leave +-2^31 steps (n sites' clipped coordinates plus a Poisson tail bound at e^-200).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from hydrafl.secagg.params import SecAggError, SecAggParams
from hydrafl.secagg.quantize import check_weights, quantise

TAIL_EXPONENT = 200.0
"""Bernstein's exponent for the noise tail `check_range` allows for: e^-200 per coordinate and round."""


@dataclass(frozen=True, slots=True)
class DistributedNoise:
    """One round's distributed DP: `sites` sites were sent the round, each update has `size` coordinates."""

    clip: float
    noise_multiplier: float
    step: float
    """gamma: one lattice step in update units (every site weighs 1, so max_weight is 1)."""
    clipping_range: float
    size: int
    sites: int

    @classmethod
    def of(cls, params: SecAggParams, size: int, sites: int) -> DistributedNoise:
        return cls(
            params.dp_clip,
            params.dp_noise_multiplier,
            2 * params.clipping_range / params.quantization_range,
            params.clipping_range,
            size,
            sites,
        )

    @property
    def bound(self) -> float:
        """C~: the L2 norm a clipped update can have after stochastic rounding (update units)."""
        return self.clip + self.step * math.sqrt(self.size)

    def site_variance(self) -> float:
        """The variance, in lattice steps, of one site's noise share on each coordinate."""
        return (self.noise_multiplier * self.bound / self.step) ** 2 / self.sites

    def encode(
        self,
        update: np.ndarray,
        params: SecAggParams,
        rng: np.random.Generator,
        weights: int | np.ndarray = 1,
    ) -> np.ndarray:
        """A site's encoded vector: `update` clipped to L2 norm C, its weight part, then the rounded update plus its
        Skellam share on every coordinate (mod 2^32). `weights`: 1, or per coordinate the 0/1 mask of the slices a
        subnetwork's site trained (exact, noiseless: the coordinator's plan already says which sites cover what).
        The share goes on every coordinate, covered or not, so every coordinate of the survivors' sum holds the
        same k / n of the noise, whoever covers it."""
        update = np.asarray(update, dtype=np.float64).ravel()
        if update.size != self.size:
            raise SecAggError(f"the update has {update.size} coordinates, the round {self.size}")
        weights = np.asarray(weights).ravel()
        check_weights(weights, params)
        encoding = Encoding(params, rng, None, self)
        quantised = encoding.quantised(update, weights, encoding.clip_factor([update]))
        return np.concatenate([weights.astype(np.uint32), quantised])

    def effective_noise_multiplier(self, survivors: int) -> float:
        """z_eff of a round whose sum holds `survivors` sites' shares (see the module docstring); 0 without noise."""
        if not self.noise_multiplier or survivors < 1:
            return 0.0
        d2 = 2 * self.bound / self.step
        d1 = math.sqrt(self.size) * d2
        mu = self.site_variance() * survivors
        return 2 / math.sqrt(d2**2 / mu + (2 * d2**2 + 3 * d1) / (2 * mu**2))

    def check_range(self) -> None:
        """SecAggError when the decoded sum of all `sites` could wrap around 2^32 (at the TAIL_EXPONENT tail)."""
        coordinate = min(self.clip, self.clipping_range) / self.step + 1
        poisson = self.site_variance() * self.sites / 2  # each of the sum's two Poissons
        tail = TAIL_EXPONENT / 3 + math.sqrt((TAIL_EXPONENT / 3) ** 2 + 2 * TAIL_EXPONENT * poisson)
        if self.sites * coordinate + 2 * tail >= 2**31:
            raise SecAggError(
                f"dp-noise-multiplier {self.noise_multiplier:g} x dp-clip {self.clip:g} over {self.sites} sites "
                f"could wrap the 2^32 field; lower the noise multiplier or the clipping bound"
            )


def skellam(rng: np.random.Generator, variance: float, size: int) -> np.ndarray:
    """`size` draws of Skellam noise of `variance` (Poisson(variance / 2) - Poisson(variance / 2)), as int64."""
    half = variance / 2
    return rng.poisson(half, size) - rng.poisson(half, size)


@dataclass(frozen=True, slots=True)
class Encoding:
    """How a site encodes its update, whole (`DistributedNoise.encode`) or a window at a time (the site's
    `masked_upload`): with the round's `params` and its own random draws, scaled down first to the honest-site
    `bound` (`--secagg-clip`) when its L2 norm is above it, then, under distributed DP (`noise`), to the norm
    C, with the site's Skellam share on every coordinate."""

    params: SecAggParams
    rng: np.random.Generator
    bound: float | None = None
    noise: DistributedNoise | None = None

    def clip_factor(self, pieces: Iterable[np.ndarray]) -> float:
        """What the update (float64 `pieces` of it) is scaled by: the honest-site bound's, then C's."""
        if not self.bound and self.noise is None:
            return 1.0
        norm = math.sqrt(sum(float(np.dot(piece, piece)) for piece in pieces))
        if not math.isfinite(norm):
            raise SecAggError("the update has NaN or infinite values")
        factor = self.bound / norm if self.bound and norm > self.bound else 1.0
        if self.noise is not None and norm * factor > self.noise.clip:
            factor *= self.noise.clip / (norm * factor)
        return factor

    def quantised(self, window: np.ndarray, weights: np.ndarray, factor: float) -> np.ndarray:
        """A window of the update scaled by `factor`, quantised (`quantize.quantise`: the random draws one call
        over the whole makes, in order), and given its Skellam share under DP (mod 2^32)."""
        if not np.all(np.isfinite(window)):
            raise SecAggError("the update has NaN or infinite values")
        scaled = window * factor if factor != 1.0 else window
        piece = quantise(scaled, weights, self.params, self.rng)
        if self.noise is not None:  # two's complement: mod 2^32
            piece += skellam(self.rng, self.noise.site_variance(), piece.size).astype(np.uint32)
        return piece
