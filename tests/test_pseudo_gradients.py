"""Pseudo-gradient noise scale and cosine to the full-data delta, against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from hydrafl.server.aggregation.pseudo_gradients import (
    DeltaMoments,
    ZeroDeltaError,
    cosine_to_reference,
    mean_delta,
    noise_scale,
)


def _d(*values: float) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor(values)}


def test_orthogonal_unit_deltas_by_hand() -> None:
    # Mean [.5, .5], ||mean||^2 = .5; deviations [.5, -.5] and [-.5, .5], each ||.||^2 = .5, summed 1.
    deltas = [_d(1.0, 0.0), _d(0.0, 1.0)]
    torch.testing.assert_close(
        mean_delta(deltas)["w"], torch.tensor([0.5, 0.5], dtype=torch.float64)
    )
    assert noise_scale(deltas) == pytest.approx(2.0, rel=1e-12)  # tr Cov = 1 / (2 - 1) = 1
    assert noise_scale(deltas, estimator="weighted") == pytest.approx(
        1.0, rel=1e-12
    )  # tr Cov = 1 / 2


def test_sample_weights_by_hand() -> None:
    # Weights 3, 1: mean [.75, .25], ||mean||^2 = .625; weighted squared deviations 3 * .125 + 1 * 1.125 = 1.5.
    deltas = [_d(1.0, 0.0), _d(0.0, 1.0)]
    torch.testing.assert_close(
        mean_delta(deltas, [3, 1])["w"], torch.tensor([0.75, 0.25], dtype=torch.float64)
    )
    # unbiased: V1 = 4, V2 = 10, 1.5 / (4 - 10 / 4) = 1 -> 1 / .625
    assert noise_scale(deltas, [3, 1]) == pytest.approx(1.6, rel=1e-12)
    # weighted: 1.5 / 4 = .375 -> .375 / .625
    assert noise_scale(deltas, [3, 1], estimator="weighted") == pytest.approx(0.6, rel=1e-12)


def test_several_tensors_flatten_together() -> None:
    # Same numbers as the orthogonal example, split over two tensors of different shapes.
    deltas = [
        {"a": torch.tensor([1.0]), "b": torch.zeros(1, 1)},
        {"a": torch.tensor([0.0]), "b": torch.ones(1, 1)},
    ]
    assert noise_scale(deltas) == pytest.approx(2.0, rel=1e-12)
    mean = mean_delta(deltas)
    assert mean["b"].shape == (1, 1)
    # cos([.5, .5], [1, 0]) = 1 / sqrt(2)
    assert cosine_to_reference(
        mean, {"a": torch.tensor([1.0]), "b": torch.zeros(1, 1)}
    ) == pytest.approx(1 / math.sqrt(2), rel=1e-12)


def test_three_sites_unbiased_matches_torch_cov() -> None:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 5, generator=generator, dtype=torch.float64) + 1.0
    deltas = [{"w": row[:2], "v": row[2:]} for row in rows]
    expected = float(torch.cov(rows.T).trace() / rows.mean(0).pow(2).sum())
    assert noise_scale(deltas) == pytest.approx(expected, rel=1e-12)
    # Integer sample counts equal frequency weights for the population estimator.
    expected_weighted = float(
        torch.cov(rows.T, fweights=torch.tensor([2, 1, 3]), correction=0).trace()
    )
    expected_weighted /= float(
        (torch.tensor([2.0, 1, 3], dtype=torch.float64) @ rows / 6).pow(2).sum()
    )
    assert noise_scale(deltas, [2, 1, 3], estimator="weighted") == pytest.approx(
        expected_weighted, rel=1e-12
    )


def test_identical_deltas_have_no_noise_and_cosine_one() -> None:
    deltas = [_d(0.3, -1.2, 2.0)] * 4
    assert noise_scale(deltas, [1, 2, 3, 4]) == 0.0
    assert cosine_to_reference(mean_delta(deltas), _d(0.3, -1.2, 2.0)) == pytest.approx(
        1.0, abs=1e-12
    )
    assert cosine_to_reference(_d(1.0, 2.0), _d(-2.0, -4.0)) == pytest.approx(-1.0, abs=1e-12)
    assert cosine_to_reference(_d(1.0, 0.0), _d(0.0, 3.0)) == pytest.approx(0.0, abs=1e-12)


def test_opposite_deltas_zero_mean() -> None:
    """Defined behaviour: a zero mean with spread is infinite noise; a zero vector has no cosine (error)."""
    deltas = [_d(1.0, 0.0), _d(-1.0, 0.0)]
    assert noise_scale(deltas) == math.inf
    assert noise_scale(deltas, estimator="weighted") == math.inf
    with pytest.raises(ZeroDeltaError, match="mean delta is zero"):
        cosine_to_reference(mean_delta(deltas), _d(1.0, 0.0))
    with pytest.raises(ZeroDeltaError, match="reference delta is zero"):
        cosine_to_reference(_d(1.0, 0.0), _d(0.0, 0.0))
    with pytest.raises(ZeroDeltaError, match="0 / 0"):
        noise_scale([_d(0.0, 0.0), _d(0.0, 0.0)])


def test_bad_inputs() -> None:
    with pytest.raises(ValueError, match="at least two sites"):
        noise_scale([_d(1.0, 2.0)])
    assert noise_scale([_d(1.0, 2.0)], estimator="weighted") == 0.0
    with pytest.raises(ValueError, match="at least two sites"):
        noise_scale([_d(1.0), _d(2.0)], [1, 0])
    with pytest.raises(ValueError, match="2 weights for 3 deltas"):
        noise_scale([_d(1.0)] * 3, [1, 1])
    with pytest.raises(ValueError, match="non-negative"):
        noise_scale([_d(1.0), _d(2.0)], [1, -1])
    with pytest.raises(ValueError, match="no deltas"):
        noise_scale([])
    with pytest.raises(ValueError, match="unknown estimator"):
        noise_scale([_d(1.0), _d(2.0)], estimator="biased")
    with pytest.raises(KeyError, match="missing"):
        noise_scale([{"a": torch.ones(1)}, {"b": torch.ones(1)}])
    with pytest.raises(ValueError, match="shape"):
        cosine_to_reference({"a": torch.ones(2)}, {"a": torch.ones(3)})


def test_streamed_moments_equal_the_batch_noise_scale_and_mean() -> None:
    gen = torch.Generator().manual_seed(4)
    common = {"w": torch.randn(5, 3, generator=gen), "b": torch.randn(3, generator=gen)}
    deltas = [
        {k: v + 0.7 * torch.randn(v.shape, generator=gen) for k, v in common.items()}
        for _ in range(6)
    ]
    weights = [10.0, 3.0, 7.0, 1.0, 12.0, 5.0]
    moments = DeltaMoments()
    for delta, weight in zip(deltas, weights, strict=True):
        moments.add(
            {k: v.numpy() for k, v in delta.items()}, weight
        )  # numpy, as the driver reads the wire
    for estimator in ("unbiased", "weighted"):
        expected = noise_scale(deltas, weights, estimator=estimator)
        assert moments.noise_scale(estimator=estimator) == pytest.approx(expected, rel=1e-10)
    for name, value in mean_delta(deltas, weights).items():
        torch.testing.assert_close(moments.mean()[name], value, rtol=1e-12, atol=1e-12)
    with pytest.raises(KeyError, match="missing"):
        moments.add({"w": common["w"]}, 1.0)
    with pytest.raises(ValueError, match="two sites"):
        single = DeltaMoments()
        single.add(common, 1.0)
        single.noise_scale()
