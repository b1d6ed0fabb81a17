"""The run's epsilon is dp-accounting's own, for the sampling the run used, and calibration inverts it."""

from __future__ import annotations

import math

import dp_accounting
import pytest
from dp_accounting.rdp import RdpAccountant

from hydrafl.privacy.accountant import AccountingError, RoundSample, calibrate_noise_multiplier, epsilon

DELTA = 1e-5


def test_all_sites_every_round_is_the_plain_gaussian_composed_r_times():
    reference = RdpAccountant()  # add/remove one site: the sum's sensitivity is C
    reference.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(1.2), 25))
    assert epsilon(1.2, RoundSample(8, 8), delta=DELTA, repeat=25) == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    assert 5 < reference.get_epsilon(DELTA) < 50


def test_a_fixed_sample_without_replacement_is_replace_one_with_the_doubled_sensitivity():
    reference = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    event = dp_accounting.SampledWithoutReplacementDpEvent(20, 5, dp_accounting.GaussianDpEvent(1.5 / 2))
    reference.compose(event, 10)
    spent = epsilon(1.5, RoundSample(5, 20), delta=DELTA, repeat=10)
    assert spent == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    assert spent < epsilon(1.5, RoundSample(20, 20), delta=DELTA, repeat=10) * 2  # amplification pays for it here


def test_poisson_sampling_is_add_remove_with_the_sampling_probability():
    reference = RdpAccountant()
    reference.compose(dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0)), 30)
    spent = epsilon(1.0, RoundSample(5, 20), delta=DELTA, repeat=30, sampling="poisson")
    assert spent == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)


def test_rounds_of_different_samples_compose_and_spending_only_grows():
    rounds = [RoundSample(4, 4), RoundSample(3, 4), RoundSample(4, 4)]
    reference = RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    reference.compose(dp_accounting.GaussianDpEvent(0.5), 2)  # replace-one over the whole run: z / 2 throughout
    reference.compose(dp_accounting.SampledWithoutReplacementDpEvent(4, 3, dp_accounting.GaussianDpEvent(0.5)))
    assert epsilon(1.0, rounds, delta=DELTA) == pytest.approx(reference.get_epsilon(DELTA), rel=1e-12)
    spent = [epsilon(2.0, RoundSample(10, 10), delta=DELTA, repeat=r) for r in (1, 2, 5, 10)]
    assert spent == sorted(spent) and len(set(spent)) == 4


def test_no_noise_is_infinite_and_no_round_is_zero():
    assert epsilon(0.0, RoundSample(4, 4), delta=DELTA) == math.inf
    assert epsilon(1.0, [], delta=DELTA) == 0.0


@pytest.mark.parametrize(("sample", "sampling"), [(RoundSample(20, 20), "fixed"), (RoundSample(5, 20), "poisson")])
def test_calibration_gives_the_noise_that_spends_the_target(sample, sampling):
    z = calibrate_noise_multiplier(4.0, sample, 30, delta=DELTA, sampling=sampling)
    assert epsilon(z, sample, delta=DELTA, repeat=30, sampling=sampling) == pytest.approx(4.0, abs=1e-3)
    assert epsilon(z * 0.95, sample, delta=DELTA, repeat=30, sampling=sampling) > 4.0


def test_bad_parameters_are_named():
    with pytest.raises(AccountingError, match="1..4 sites, got 5"):
        RoundSample(5, 4)
    with pytest.raises(AccountingError, match="delta"):
        epsilon(1.0, RoundSample(4, 4), delta=2.0)
    with pytest.raises(AccountingError, match="unknown sampling 'shuffle'"):
        epsilon(1.0, RoundSample(4, 4), delta=DELTA, sampling="shuffle")
    with pytest.raises(AccountingError, match="target epsilon"):
        calibrate_noise_multiplier(0.0, RoundSample(4, 4), 3, delta=DELTA)
