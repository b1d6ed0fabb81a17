"""The run's epsilon, checked as an auditor would: under replace-one neighbours every round is a Gaussian
mechanism with mu = 2 / z, so full participation must match formulas written here (Renyi DP of the Gaussian,
and the analytic Gaussian's exact privacy curve); sampling may only lower epsilon; calibration inverts it."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from hydrafl.privacy.accountant import (
    PLD_DISCRETISATION,
    AccountingError,
    RoundSample,
    calibrate_distributed_noise_multiplier,
    calibrate_noise_multiplier,
    distributed_epsilon,
    epsilon,
    exact_epsilon,
    local_epsilon,
)

DELTA = 1e-5
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _rdp_gaussian_epsilon(z: float, rounds: int, delta: float) -> float:
    """Renyi DP by hand: the sum's replace-one sensitivity is 2C and its noise std zC, so each round has RDP
    alpha (2/z)^2 / 2 at order alpha; converted with Canonne, Kamath and Steinke (2020, Prop. 12):
    eps = rdp + log((alpha - 1) / alpha) - (log(delta) + log(alpha)) / (alpha - 1), minimised over alpha."""
    alpha = np.linspace(1.001, 200.0, 400_000)
    rdp = rounds * alpha * (2 / z) ** 2 / 2
    return float(
        np.min(rdp + np.log((alpha - 1) / alpha) - (math.log(delta) + np.log(alpha)) / (alpha - 1))
    )


def _gaussian_delta(eps: float, mu: float) -> float:
    """The analytic Gaussian mechanism's exact delta(eps) (Balle and Wang, 2018)."""
    phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))  # noqa: E731  (the standard normal CDF)
    return phi(-eps / mu + mu / 2) - math.exp(eps) * phi(-eps / mu - mu / 2)


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """The smallest eps with delta(eps) <= delta, by bisection (delta(eps) falls as eps grows)."""
    low, high = 0.0, 1000.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if _gaussian_delta(middle, mu) > delta else (low, middle)
    return high


@pytest.mark.parametrize(("z", "rounds"), [(1.1, 5), (1.2, 25), (3.0, 1), (0.8, 100)])
def test_full_participation_is_the_gaussian_with_mu_two_over_z_by_renyi_dp_by_hand(z, rounds):
    by_hand = _rdp_gaussian_epsilon(z, rounds, DELTA)
    spent = epsilon(z, RoundSample(8, 8), delta=DELTA, repeat=rounds)
    assert by_hand <= spent + 1e-9  # dp-accounting minimises over fewer orders than the grid here
    assert spent == pytest.approx(by_hand, rel=2e-3)


@pytest.mark.parametrize(("z", "rounds"), [(1.1, 1), (2.0, 1), (0.7, 1), (1.1, 5), (1.2, 25)])
def test_the_exact_accountant_is_the_analytic_gaussian(z, rounds):
    mu = math.sqrt(rounds) * 2 / z  # R Gaussians with mu each compose to one with mu sqrt(R)
    spent = exact_epsilon(z, RoundSample(4, 4), delta=DELTA, repeat=rounds)
    assert spent == pytest.approx(_gaussian_epsilon(mu, DELTA), abs=1e-3)
    assert _gaussian_delta(spent, mu) <= DELTA * (
        1 + 1e-6
    )  # the discretisation errs on the safe side


@pytest.mark.parametrize("z", [0.7, 1.1, 2.0, 5.0])
def test_the_exact_epsilon_is_below_renyi_dp_and_not_far_below(z):
    for rounds in (1, 5, 50):
        rdp = epsilon(z, RoundSample(4, 4), delta=DELTA, repeat=rounds)
        exact = exact_epsilon(z, RoundSample(4, 4), delta=DELTA, repeat=rounds)
        assert 0.5 * rdp < exact <= rdp


def test_sampling_fewer_sites_never_raises_epsilon_above_full_participation():
    for spend in (epsilon, exact_epsilon):
        spent = [spend(1.1, RoundSample(m, 4), delta=DELTA, repeat=5) for m in (4, 3, 2, 1)]
        assert spent == sorted(spent, reverse=True)
    # 3 of 4 amplified alone is above the unamplified bound; the reported epsilon is the smaller of the two
    amplified = RdpAccountant(neighboring_relation=REPLACE_ONE)
    amplified.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(4, 3, dp_accounting.GaussianDpEvent(0.55)), 5
    )
    full = epsilon(1.1, RoundSample(4, 4), delta=DELTA, repeat=5)
    assert (
        amplified.get_epsilon(DELTA)
        > full
        == epsilon(1.1, RoundSample(3, 4), delta=DELTA, repeat=5)
    )


def test_a_fixed_sample_without_replacement_is_amplified_under_the_same_relation():
    reference = RdpAccountant(neighboring_relation=REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(
        20, 5, dp_accounting.GaussianDpEvent(1.5 / 2)
    )
    reference.compose(event, 10)
    spent = epsilon(1.5, RoundSample(5, 20), delta=DELTA, repeat=10)
    assert spent == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    assert spent < epsilon(1.5, RoundSample(20, 20), delta=DELTA, repeat=10)
    # the PLD accountant has no replace-one event for it: those rounds count unamplified
    assert exact_epsilon(1.5, RoundSample(5, 20), delta=DELTA, repeat=10) == exact_epsilon(
        1.5, RoundSample(20, 20), delta=DELTA, repeat=10
    )


def test_poisson_sampling_is_replace_one_too():
    unamplified = epsilon(1.0, RoundSample(20, 20), delta=DELTA, repeat=30)
    assert (
        epsilon(1.0, RoundSample(5, 20), delta=DELTA, repeat=30, sampling="poisson") == unamplified
    )  # no RDP bound
    reference = PLDAccountant(REPLACE_ONE, value_discretization_interval=PLD_DISCRETISATION)
    reference.compose(
        dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0)), 30
    )
    exact = exact_epsilon(1.0, RoundSample(5, 20), delta=DELTA, repeat=30, sampling="poisson")
    assert exact == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    assert exact < exact_epsilon(1.0, RoundSample(20, 20), delta=DELTA, repeat=30)


def test_rounds_of_different_samples_compose_and_spending_only_grows():
    rounds = [RoundSample(4, 4), RoundSample(1, 4), RoundSample(4, 4)]
    reference = RdpAccountant(neighboring_relation=REPLACE_ONE)
    reference.compose(dp_accounting.GaussianDpEvent(0.5), 2)
    reference.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(4, 1, dp_accounting.GaussianDpEvent(0.5))
    )
    assert reference.get_epsilon(DELTA) < epsilon(1.0, RoundSample(4, 4), delta=DELTA, repeat=3)
    assert epsilon(1.0, rounds, delta=DELTA) == pytest.approx(
        reference.get_epsilon(DELTA), rel=1e-12
    )
    for spend in (epsilon, exact_epsilon):
        spent = [spend(2.0, RoundSample(10, 10), delta=DELTA, repeat=r) for r in (1, 2, 5, 10)]
        assert spent == sorted(spent) and len(set(spent)) == 4


def test_a_sites_local_epsilon_is_one_site_every_round():
    assert local_epsilon(2.0, 7, delta=DELTA) == epsilon(
        2.0, RoundSample(1, 1), delta=DELTA, repeat=7
    )
    assert local_epsilon(2.0, 1, delta=DELTA) == pytest.approx(
        _rdp_gaussian_epsilon(2.0, 1, DELTA), rel=2e-3
    )


def test_no_noise_is_infinite_and_no_round_is_zero():
    for spend in (epsilon, exact_epsilon):
        assert spend(0.0, RoundSample(4, 4), delta=DELTA) == math.inf
        assert spend(1.0, [], delta=DELTA) == 0.0


@pytest.mark.parametrize(
    ("sample", "sampling"),
    [
        (RoundSample(20, 20), "fixed"),
        (RoundSample(5, 20), "fixed"),
        (RoundSample(5, 20), "poisson"),
    ],
)
def test_calibration_gives_the_noise_that_spends_the_target(sample, sampling):
    z = calibrate_noise_multiplier(4.0, sample, 30, delta=DELTA, sampling=sampling)
    assert epsilon(z, sample, delta=DELTA, repeat=30, sampling=sampling) == pytest.approx(
        4.0, abs=1e-3
    )
    assert epsilon(z, sample, delta=DELTA, repeat=30, sampling=sampling) <= 4.0
    assert epsilon(z * 0.99, sample, delta=DELTA, repeat=30, sampling=sampling) > 4.0


def test_distributed_calibration_spends_the_target_at_integer_orders():
    """A little more noise than central DP's for the same target: the Skellam's bound holds at integer orders."""
    z = calibrate_distributed_noise_multiplier(8.0, 8, delta=DELTA)
    assert distributed_epsilon([z] * 8, delta=DELTA) == pytest.approx(8.0, abs=1e-3)
    assert distributed_epsilon([z] * 8, delta=DELTA) <= 8.0
    assert distributed_epsilon([z * 0.99] * 8, delta=DELTA) > 8.0
    assert z >= calibrate_noise_multiplier(8.0, RoundSample(20, 20), 8, delta=DELTA)
    with pytest.raises(AccountingError, match="rounds must be >= 1"):
        calibrate_distributed_noise_multiplier(8.0, 0, delta=DELTA)


def test_bad_parameters_are_named():
    with pytest.raises(AccountingError, match="1..4 sites, got 5"):
        RoundSample(5, 4)
    with pytest.raises(AccountingError, match="delta"):
        epsilon(1.0, RoundSample(4, 4), delta=2.0)
    with pytest.raises(AccountingError, match="unknown sampling 'shuffle'"):
        exact_epsilon(1.0, RoundSample(4, 4), delta=DELTA, sampling="shuffle")
    with pytest.raises(AccountingError, match="target epsilon"):
        calibrate_noise_multiplier(0.0, RoundSample(4, 4), 3, delta=DELTA)
