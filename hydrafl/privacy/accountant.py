"""How much privacy a run has spent: (epsilon, delta) after some rounds of a Gaussian mechanism on the sum of
the sites' clipped updates, from Google's dp-accounting, and the inverse (the noise multiplier for a target
epsilon).

One neighbouring relation for every round and every sampling scheme: replace-one site (a site's data replaced
by arbitrary data). Consortium membership and the number of sites n are published each round, so add/remove
neighbours, which change n, would not hold. Each site's update is clipped to C and counted once and the sum
gets Gaussian noise of std z C, so two neighbouring sums differ by up to 2C: every round is a Gaussian
mechanism with mu = 2 / z, and sampling can only lower what it spends.

Two accountants, both under REPLACE_ONE, each reporting the minimum of its amplified bound and the
unamplified one (the Gaussian composed over the rounds), so sampling never raises epsilon:
- `epsilon`, Renyi DP: m of n sites without replacement is `SampledWithoutReplacementDpEvent`; dp-accounting
  has no replace-one RDP bound for Poisson sampling, so Poisson rounds count unamplified.
- `exact_epsilon`, the privacy loss distribution (PLD): exact for the Gaussian rounds (up to a pessimistic
  discretisation); Poisson rounds use dp-accounting's replace-one Poisson-subsampled Gaussian; it has no
  sampled-without-replacement event, so those rounds count unamplified.
Distributed DP (secure aggregation with the sites' Skellam noise, `hydrafl.secagg.noise`): each round is
accounted as the Gaussian whose RDP bounds the Skellam's at integer orders, its noise multiplier the round's own
(the survivors' noise), by `distributed_epsilon` at integer orders only and unamplified (the guarantee is
against the coordinator, which knows whom it sampled); there is no exact (PLD) bound for it.

dp-accounting's conventions differ here: RDP's `GaussianDpEvent(s)` is the Gaussian with mu = 1 / s whatever
the relation (so replace-one needs s = z / 2), while PLD's REPLACE_ONE Gaussian already shifts by twice the
sensitivity (so it takes z).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import lru_cache

import dp_accounting
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

SAMPLINGS = ("fixed", "poisson")
"""fixed: m of n sites without replacement each round (all sites when m == n); poisson: each site with q."""
PLD_DISCRETISATION = 1e-3
"""The PLD's privacy-loss grid: within 1e-6 of 1e-4's epsilon at 5 rounds, z 1.1, and ten times faster: about
0.2 s a call after 5 rounds, 0.7 s after 50, 4 s after 500 (the loss range grows with the composed mu)."""
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE
INTEGER_ORDERS = (*range(2, 64), 128, 256, 512)
"""RDP orders for distributed DP: the Skellam's RDP bound (Agarwal et al., Theorem 3.5) holds at integer ones."""


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


Rounds = tuple[tuple[RoundSample, int], ...]
"""Each distinct round sample with the number of rounds that used it."""


def epsilon(
    noise_multiplier: float,
    rounds: Iterable[RoundSample] | RoundSample,
    *,
    delta: float,
    repeat: int = 1,
    sampling: str = "fixed",
) -> float:
    """Renyi DP's epsilon at `delta` after the given rounds (one RoundSample per round, or one repeated `repeat`
    times); math.inf without noise, 0.0 after no round."""
    return _spend(_rdp_epsilon, noise_multiplier, rounds, delta, repeat, sampling)


def exact_epsilon(
    noise_multiplier: float,
    rounds: Iterable[RoundSample] | RoundSample,
    *,
    delta: float,
    repeat: int = 1,
    sampling: str = "fixed",
) -> float:
    """The PLD accountant's epsilon for the same rounds as `epsilon` (see the module docstring)."""
    return _spend(_pld_epsilon, noise_multiplier, rounds, delta, repeat, sampling)


def distributed_epsilon(noise_multipliers: Iterable[float], *, delta: float) -> float:
    """Renyi DP's epsilon at `delta` after distributed-DP rounds with these effective noise multipliers, at
    INTEGER_ORDERS and unamplified: the coordinator picks each round's sites, so sampling hides nothing from it;
    math.inf when a round had no noise, 0.0 after no round."""
    if not 0 < delta < 1:
        raise AccountingError(f"delta must be in (0, 1), got {delta}")
    counts: dict[float, int] = {}
    for noise_multiplier in noise_multipliers:
        if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
            raise AccountingError(f"noise multiplier must be a number >= 0, got {noise_multiplier}")
        counts[float(noise_multiplier)] = counts.get(float(noise_multiplier), 0) + 1
    if not counts:
        return 0.0
    if 0.0 in counts:
        return math.inf
    return _distributed_rdp_epsilon(tuple(sorted(counts.items())), delta)


def calibrate_noise_multiplier(
    target_epsilon: float,
    sample: RoundSample,
    rounds: int,
    *,
    delta: float,
    sampling: str = "fixed",
    tol: float = 1e-4,
) -> float:
    """The smallest noise multiplier z (to `tol`) whose run of `rounds` such rounds spends at most
    `target_epsilon` by `epsilon`, the epsilon the run reports and the sites budget against."""
    return _smallest(
        lambda z: epsilon(z, sample, delta=delta, repeat=rounds, sampling=sampling),
        target_epsilon,
        rounds,
        tol,
    )


def calibrate_distributed_noise_multiplier(
    target_epsilon: float, rounds: int, *, delta: float, tol: float = 1e-4
) -> float:
    """The smallest effective noise multiplier z (to `tol`) whose `rounds` distributed-DP rounds spend at most
    `target_epsilon` by `distributed_epsilon` (integer orders, unamplified). With every site surviving, a
    round's z_eff is the configured z less a lattice term of about 1e-11 (`secagg.noise`)."""
    return _smallest(
        lambda z: distributed_epsilon([z] * rounds, delta=delta), target_epsilon, rounds, tol
    )


def _smallest(
    spent: Callable[[float], float], target_epsilon: float, rounds: int, tol: float
) -> float:
    """The smallest z (to `tol`) with spent(z) <= target_epsilon; epsilon falls as z grows."""
    if not (math.isfinite(target_epsilon) and target_epsilon > 0):
        raise AccountingError(f"target epsilon must be a positive number, got {target_epsilon}")
    if rounds < 1:
        raise AccountingError(f"rounds must be >= 1, got {rounds}")
    low, high = 0.0, 1.0
    while spent(high) > target_epsilon:
        low, high = high, high * 2
    while high - low > tol:
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > target_epsilon else (low, middle)
    return high


def local_epsilon(noise_multiplier: float, participations: int, *, delta: float) -> float:
    """A site's own (local DP) epsilon after `participations` noised replies: each one the same Gaussian
    mechanism as a round of central DP with one site (any two updates of norm <= C differ by at most 2C);
    math.inf without noise."""
    return epsilon(noise_multiplier, RoundSample(1, 1), delta=delta, repeat=participations)


def _spend(
    accountant: Callable[[float, Rounds, float, str], float],
    noise_multiplier: float,
    rounds: Iterable[RoundSample] | RoundSample,
    delta: float,
    repeat: int,
    sampling: str,
) -> float:
    if sampling not in SAMPLINGS:
        raise AccountingError(
            f"unknown sampling {sampling!r}; choose one of {', '.join(SAMPLINGS)}"
        )
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise AccountingError(f"noise multiplier must be a number >= 0, got {noise_multiplier}")
    if not 0 < delta < 1:
        raise AccountingError(f"delta must be in (0, 1), got {delta}")
    samples = [rounds] * repeat if isinstance(rounds, RoundSample) else list(rounds)
    if not samples:
        return 0.0
    if noise_multiplier == 0:
        return math.inf
    counts: dict[RoundSample, int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    ordered = tuple(sorted(counts.items(), key=lambda item: (item[0].sampled, item[0].population)))
    return accountant(float(noise_multiplier), ordered, delta, sampling)


@lru_cache(maxsize=256)
def _rdp_epsilon(noise_multiplier: float, rounds: Rounds, delta: float, sampling: str) -> float:
    """Cached: the driver asks before a round (its preview) and after it (its record) for the same rounds."""
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier / 2)

    def event(sample: RoundSample) -> dp_accounting.DpEvent:
        if sampling == "poisson" or sample.sampled == sample.population:
            return gaussian
        return dp_accounting.SampledWithoutReplacementDpEvent(
            sample.population, sample.sampled, gaussian
        )

    return _least(
        lambda: RdpAccountant(neighboring_relation=REPLACE_ONE), gaussian, event, rounds, delta
    )


@lru_cache(maxsize=256)
def _pld_epsilon(noise_multiplier: float, rounds: Rounds, delta: float, sampling: str) -> float:
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)

    def event(sample: RoundSample) -> dp_accounting.DpEvent:
        if sampling == "fixed" or sample.sampled == sample.population:
            return gaussian
        return dp_accounting.PoissonSampledDpEvent(sample.sampled / sample.population, gaussian)

    return _least(
        lambda: PLDAccountant(REPLACE_ONE, value_discretization_interval=PLD_DISCRETISATION),
        gaussian,
        event,
        rounds,
        delta,
    )


@lru_cache(maxsize=256)
def _distributed_rdp_epsilon(rounds: tuple[tuple[float, int], ...], delta: float) -> float:
    accountant = RdpAccountant(INTEGER_ORDERS, REPLACE_ONE)
    for noise_multiplier, count in rounds:
        accountant.compose(dp_accounting.GaussianDpEvent(noise_multiplier / 2), count)
    return float(accountant.get_epsilon(delta))


def _least(
    make_accountant: Callable[[], dp_accounting.PrivacyAccountant],
    gaussian: dp_accounting.DpEvent,
    event: Callable[[RoundSample], dp_accounting.DpEvent],
    rounds: Rounds,
    delta: float,
) -> float:
    """The smaller of the amplified bound (each round's own event) and the unamplified one (the Gaussian)."""
    unamplified = make_accountant()
    unamplified.compose(gaussian, sum(count for _, count in rounds))
    spent = unamplified.get_epsilon(delta)
    if any(event(sample) != gaussian for sample, _ in rounds):
        amplified = make_accountant()
        for sample, count in rounds:
            amplified.compose(event(sample), count)
        spent = min(spent, amplified.get_epsilon(delta))
    return float(spent)
