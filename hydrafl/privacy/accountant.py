"""How much privacy a run has spent: (epsilon, delta) after some rounds of a Gaussian mechanism on the sum of
the sites' clipped updates, from Google's dp-accounting RDP accountant, and the inverse (the noise multiplier
for a target epsilon).

Neighbouring federations differ in one site. Sampling decides the relation the accountant may use:
- every site trains every round: add/remove one site, the sum's sensitivity is C, the plain Gaussian with
  noise multiplier z composed R times;
- a fixed number m of n sites sampled without replacement (Flower's `sample_nodes`): dp-accounting's bound
  needs replace-one neighbours, under which two sums differ by up to 2C, so the mechanism's own noise
  multiplier is z / 2 (the amplification by sampling usually more than pays for it when m << n);
- Poisson sampling with probability q: add/remove, z.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

import dp_accounting
from dp_accounting.rdp import RdpAccountant

SAMPLINGS = ("fixed", "poisson")
"""fixed: m of n sites without replacement each round (all sites when m == n); poisson: each site with q."""


class AccountingError(ValueError):
    """Parameters the accountant cannot account (a sample larger than the population, a bad delta)."""


@dataclass(frozen=True, slots=True)
class RoundSample:
    """Who could have been sampled in one round and how many were: the accountant's view of a round."""

    sampled: int
    population: int

    def __post_init__(self) -> None:
        if not 1 <= self.sampled <= self.population:
            raise AccountingError(f"a round samples 1..{self.population} sites, got {self.sampled}")


def round_event(
    noise_multiplier: float, sample: RoundSample, *, sampling: str = "fixed", replace_one: bool | None = None
) -> dp_accounting.DpEvent:
    """One round's release as a DpEvent (see the module docstring for the neighbouring relations).
    `replace_one`: account under replace-one neighbours (default: when the round is subsampled without
    replacement; a run that mixes such rounds with full ones accounts all of them so)."""
    _check(noise_multiplier, sampling)
    if sampling == "poisson":
        return dp_accounting.PoissonSampledDpEvent(
            sample.sampled / sample.population, dp_accounting.GaussianDpEvent(noise_multiplier)
        )
    replace_one = sample.sampled < sample.population if replace_one is None else replace_one
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2 if replace_one else noise_multiplier)
    if sample.sampled == sample.population:
        return gaussian
    return dp_accounting.SampledWithoutReplacementDpEvent(sample.population, sample.sampled, gaussian)


def epsilon(
    noise_multiplier: float, rounds: Iterable[RoundSample] | RoundSample, *, delta: float, repeat: int = 1,
    sampling: str = "fixed",
) -> float:
    """Epsilon at `delta` after the given rounds (one RoundSample per round, or one repeated `repeat` times);
    math.inf without noise, 0.0 after no round."""
    samples = [rounds] * repeat if isinstance(rounds, RoundSample) else list(rounds)
    if not 0 < delta < 1:
        raise AccountingError(f"delta must be in (0, 1), got {delta}")
    if not samples:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    counts: dict[RoundSample, int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    return _epsilon(float(noise_multiplier), tuple(sorted(counts.items(), key=_order)), delta, sampling)


def calibrate_noise_multiplier(
    target_epsilon: float, sample: RoundSample, rounds: int, *, delta: float, sampling: str = "fixed"
) -> float:
    """The smallest noise multiplier z whose run of `rounds` such rounds spends at most `target_epsilon`."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise AccountingError(f"target epsilon must be a positive number, got {target_epsilon}")
    if rounds < 1:
        raise AccountingError(f"rounds must be >= 1, got {rounds}")
    return float(
        dp_accounting.calibrate_dp_mechanism(
            lambda: _accountant(sampling == "fixed" and sample.sampled < sample.population),
            lambda z: dp_accounting.SelfComposedDpEvent(round_event(z, sample, sampling=sampling), rounds),
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(1e-3, 1.0),
            tol=1e-4,
        )
    )


@lru_cache(maxsize=256)
def _epsilon(
    noise_multiplier: float, counts: tuple[tuple[RoundSample, int], ...], delta: float, sampling: str
) -> float:
    """Cached: the driver asks before a round (its preview) and after it (its record) for the same rounds."""
    replace_one = sampling == "fixed" and any(sample.sampled < sample.population for sample, _ in counts)
    accountant = _accountant(replace_one)
    for sample, count in counts:
        accountant.compose(round_event(noise_multiplier, sample, sampling=sampling, replace_one=replace_one), count)
    return float(accountant.get_epsilon(delta))


def _accountant(replace_one: bool) -> RdpAccountant:
    relation = dp_accounting.NeighboringRelation
    return RdpAccountant(neighboring_relation=relation.REPLACE_ONE if replace_one else relation.ADD_OR_REMOVE_ONE)


def _check(noise_multiplier: float, sampling: str) -> None:
    if sampling not in SAMPLINGS:
        raise AccountingError(f"unknown sampling {sampling!r}; choose one of {', '.join(SAMPLINGS)}")
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise AccountingError(f"noise multiplier must be a number >= 0, got {noise_multiplier}")


def _order(item: tuple[RoundSample, int]) -> tuple[int, int]:
    return item[0].sampled, item[0].population


def local_epsilon(noise_multiplier: float, participations: int, *, delta: float) -> float:
    """A site's own (local DP) epsilon after `participations` noised replies: each one a Gaussian mechanism on
    its clipped update, whose sensitivity is 2C (any two updates of norm <= C differ by at most 2C), so the
    mechanism's noise multiplier is z_local / 2; math.inf without noise."""
    return epsilon(noise_multiplier / 2, RoundSample(1, 1), delta=delta, repeat=participations)
