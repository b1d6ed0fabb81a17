"""Outer-momentum stability criterion: doc numbers, limits, exact moment recursion and Monte-Carlo."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from hydrafl.server.aggregation.stability import (
    OuterSetup,
    StabilityVerdict,
    check,
    check_spectrum,
    exact_second_moment_rate,
    marker_style,
    max_stable_outer_lr,
    mode_moments,
    moment_radius,
    monte_carlo_growth,
    plot_stable_region,
    stability_limit,
    u_limit,
)

# The doc's worked examples: mu = 0.9, h = 1, v = 2 (Gaussian features), outer Nesterov.
BASE = OuterSetup(
    inner_lr=0.1,
    curvature=1.0,
    curvature_var=2.0,
    batch_size=1,
    local_steps=10,
    sites=1,
    outer_lr=0.7,
    momentum=0.9,
)


def test_mode_moments_match_doc_examples() -> None:
    c, v = mode_moments(BASE)
    assert round(c, 3) == 0.651
    assert round(v, 3) == 0.034
    c, v = mode_moments(replace(BASE, inner_lr=0.5))
    assert round(c, 3) == 0.999
    assert round(v, 3) == 0.056


def test_mode_moments_closed_forms() -> None:
    # a = 0.9, q = 0.83: c = 1 - a^H, V = (q^H - a^2H) / M, noise exactly 1/M and ~1/b.
    c, v = mode_moments(BASE)
    assert c == pytest.approx(1 - 0.9**10, rel=1e-14)
    assert v == pytest.approx(0.83**10 - 0.81**10, rel=1e-12)
    assert mode_moments(replace(BASE, sites=8))[1] == pytest.approx(v / 8, rel=1e-14)
    assert mode_moments(replace(BASE, batch_size=8))[1] == pytest.approx(
        (0.81 + 0.02 / 8) ** 10 - 0.81**10, rel=1e-12
    )
    # Tiny eta h keeps relative accuracy (no cancellation in 1 - a^H).
    c_small, v_small = mode_moments(replace(BASE, inner_lr=1e-12))
    assert c_small == pytest.approx(10e-12, rel=1e-9)
    assert v_small == pytest.approx(10 * 2e-24, rel=1e-6)


# (overrides, exact gamma* from the closed form, value printed in the doc)
DOC_EXAMPLES = [
    ({}, 1.864485, 1.87),
    ({"batch_size": 8}, 2.057051, 2.06),
    ({"sites": 8}, 2.054328, 2.06),
    ({"inner_lr": 0.5}, 1.254346, 1.26),
    ({"inner_lr": 0.5, "sites": 8}, 1.344793, 1.35),
]


@pytest.mark.parametrize(("overrides", "exact", "doc"), DOC_EXAMPLES)
def test_doc_gamma_star_examples(overrides: dict[str, float], exact: float, doc: float) -> None:
    setup = replace(BASE, **overrides)
    gamma_star = max_stable_outer_lr(setup)
    assert gamma_star == pytest.approx(exact, abs=2e-6)
    # Arbiter: the exact second-moment recursion puts the edge exactly there.
    assert exact_second_moment_rate(replace(setup, outer_lr=gamma_star)) == pytest.approx(
        1.0, abs=1e-9
    )
    # The doc's numbers are gamma* rounded *up* to 0.01 (the first unstable point of a 0.01 grid),
    # so the doc's value itself is already (slightly) unstable.
    assert math.ceil(gamma_star * 100) / 100 == pytest.approx(doc)
    assert not check(replace(setup, outer_lr=doc)).stable
    assert exact_second_moment_rate(replace(setup, outer_lr=doc)) > 1.0


@pytest.mark.parametrize(
    ("sites", "expected"), [(1, 0.42), (2, 0.72), (4, 0.97), (8, 1.14), (16, 1.24)]
)
def test_inner_edge_regime_q_at_least_one(sites: int, expected: float) -> None:
    # eta h = 1, v = b: a = 0, q = 1, so c = 1 and V = 1/M exactly.
    exact_edge = OuterSetup(
        inner_lr=1.0,
        curvature=1.0,
        curvature_var=1.0,
        batch_size=1,
        local_steps=7,
        sites=sites,
        outer_lr=0.7,
        momentum=0.9,
    )
    c, v = mode_moments(exact_edge)
    assert (c, v) == (pytest.approx(1.0), pytest.approx(1.0 / sites))
    assert round(max_stable_outer_lr(exact_edge), 2) == expected
    # Formula level: w = u^2 / M on the edge.
    u_star = max_stable_outer_lr(exact_edge)
    assert u_star**2 / sites == pytest.approx(stability_limit(u_star, 0.9, True), rel=1e-9)
    # A less degenerate realisation: eta h = 0.5, v = 3b gives q = 1; c ~ 1, V = (1 - a^2H)/M.
    natural = OuterSetup(
        inner_lr=0.5,
        curvature=1.0,
        curvature_var=12.0,
        batch_size=4,
        local_steps=20,
        sites=sites,
        outer_lr=0.7,
        momentum=0.9,
    )
    c, v = mode_moments(natural)
    assert c == pytest.approx(1.0, abs=1e-6)
    assert v == pytest.approx((1 - 0.25**20) / sites, rel=1e-12)
    assert round(max_stable_outer_lr(natural), 2) == expected
    # DiLoCo's gamma = 0.7, mu = 0.9 needs M >= 2 here.
    assert check(natural).stable is (sites >= 2)


def test_mu_zero_reduces_to_plain_sgd() -> None:
    for u in np.linspace(0.01, 1.99, 50):
        assert stability_limit(u, 0.0, True) == pytest.approx(u * (2 - u), rel=1e-12)
        assert stability_limit(u, 0.0, False) == pytest.approx(u * (2 - u), rel=1e-12)
    # E[(1 - gamma C)^2] < 1  <=>  gamma < 2c / (c^2 + V).
    setup = replace(BASE, momentum=0.0)
    c, v = mode_moments(setup)
    assert max_stable_outer_lr(setup) == pytest.approx(2 * c / (c * c + v), rel=1e-12)
    assert max_stable_outer_lr(replace(setup, nesterov=False)) == pytest.approx(
        2 * c / (c * c + v), rel=1e-12
    )


@pytest.mark.parametrize("mu", [0.0, 0.3, 0.9, 0.99])
def test_noise_free_edges(mu: float) -> None:
    quiet = replace(BASE, curvature_var=0.0, momentum=mu)
    c, v = mode_moments(quiet)
    assert v == 0.0
    assert max_stable_outer_lr(quiet) * c == pytest.approx(2 * (1 + mu) / (1 + 2 * mu), rel=1e-12)
    assert max_stable_outer_lr(replace(quiet, nesterov=False)) * c == pytest.approx(
        2 * (1 + mu), rel=1e-12
    )


def test_edge_values_and_range() -> None:
    assert u_limit(0.9) == pytest.approx(1.357, abs=5e-4)
    assert u_limit(0.9, nesterov=False) == pytest.approx(3.8)
    for nesterov in (True, False):
        edge = u_limit(0.9, nesterov)
        assert stability_limit(0.0, 0.9, nesterov) == 0.0
        assert stability_limit(-0.1, 0.9, nesterov) == 0.0
        assert stability_limit(edge, 0.9, nesterov) == 0.0
        assert stability_limit(edge * 1.01, 0.9, nesterov) == 0.0
        assert stability_limit(edge * 0.999, 0.9, nesterov) > 0.0


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.99])
def test_small_u_noise_limit(nesterov: bool, mu: float) -> None:
    # Noise-dominated regime: W ~ 2 (1 - mu) u, i.e. gamma V / c < 2 (1 - mu).
    u = 1e-7
    assert stability_limit(u, mu, nesterov) / u == pytest.approx(2 * (1 - mu), rel=1e-5)


def test_heavy_ball_formula_and_limits() -> None:
    mu = 0.9
    for u in (0.1, 1.0, 3.0):
        assert stability_limit(u, mu, False) == pytest.approx(
            u * (1 - mu) * (2 * (1 + mu) - u) / (1 + mu)
        )
    # heavy ball tolerates larger u but less noise at small u than Nesterov for the same mu > 0
    assert u_limit(mu, False) > u_limit(mu, True)
    setup = replace(BASE, nesterov=False)
    assert max_stable_outer_lr(setup) == pytest.approx(2.329846, abs=2e-6)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"inner_lr": 0.5},
        {"inner_lr": 1.0, "curvature_var": 1.0},
        {"momentum": 0.0},
        {"momentum": 0.99, "sites": 4},
    ],
)
def test_stable_set_is_an_interval(nesterov: bool, overrides: dict[str, float]) -> None:
    setup = replace(BASE, nesterov=nesterov, **overrides)
    gamma_star = max_stable_outer_lr(setup)
    gammas = gamma_star * np.linspace(0.0013, 3.0, 1500)
    rates = np.array([exact_second_moment_rate(replace(setup, outer_lr=float(g))) for g in gammas])
    stable = rates < 1.0
    n_stable = int(stable.sum())
    assert stable[:n_stable].all() and not stable[n_stable:].any()
    assert gammas[n_stable - 1] < gamma_star <= gammas[n_stable]
    # gamma* itself is precise to well under 1e-9 relative.
    assert exact_second_moment_rate(replace(setup, outer_lr=gamma_star * (1 - 1e-7))) < 1.0
    assert exact_second_moment_rate(replace(setup, outer_lr=gamma_star * (1 + 1e-7))) > 1.0


def _random_setup(rng: np.random.Generator) -> OuterSetup:
    h = float(10 ** rng.uniform(-2, 1))
    setup = OuterSetup(
        inner_lr=float(10 ** rng.uniform(-3, math.log10(1.9))) / h,
        curvature=h,
        curvature_var=float(rng.uniform(0.0, 4.0)) * h * h,
        batch_size=int(rng.integers(1, 65)),
        local_steps=int(rng.integers(1, 51)),
        sites=int(rng.integers(1, 33)),
        outer_lr=1.0,
        momentum=float(rng.uniform(0.0, 0.99)),
        nesterov=bool(rng.integers(0, 2)),
    )
    return replace(
        setup, outer_lr=max_stable_outer_lr(setup) * float(np.exp(rng.uniform(-1.0, 1.0)))
    )


def test_check_agrees_with_exact_recursion_on_random_grid() -> None:
    rng = np.random.default_rng(1234)
    agreed = {True: 0, False: 0}
    for _ in range(1000):
        setup = _random_setup(rng)
        rate = exact_second_moment_rate(setup)
        gamma_star = max_stable_outer_lr(setup)
        if abs(rate - 1.0) < 1e-6 or abs(setup.outer_lr / gamma_star - 1.0) < 1e-6:
            continue
        verdict = check(setup)
        assert verdict.stable == (rate < 1.0), setup
        assert verdict.stable == (setup.outer_lr < gamma_star), setup
        agreed[verdict.stable] += 1
    assert min(agreed.values()) > 300


def test_formula_agrees_with_exact_recursion_in_u_w_plane() -> None:
    rng = np.random.default_rng(99)
    checked = 0
    for _ in range(1000):
        mu = float(rng.uniform(0.0, 0.995))
        nesterov = bool(rng.integers(0, 2))
        u = float(rng.uniform(-0.1, 1.1 * u_limit(mu, nesterov)))
        w = float(rng.uniform(0.0, 1.2 * max(stability_limit(u, mu, nesterov), 1e-3)))
        rate = moment_radius(u, w, mu, nesterov)
        if abs(rate - 1.0) < 1e-6:
            continue
        assert (w < stability_limit(u, mu, nesterov)) == (rate < 1.0), (u, w, mu, nesterov)
        checked += 1
    assert checked > 990


def test_non_contracting_mode_has_no_stable_outer_lr() -> None:
    # eta h = 2.5 with even H: a^H = 2.25 > 1, so c < 0.
    setup = replace(BASE, inner_lr=2.5, local_steps=2)
    c, _ = mode_moments(setup)
    assert c < 0
    assert max_stable_outer_lr(setup) == 0.0
    assert not check(setup).stable


MC_CASES = [
    {},
    {"batch_size": 8, "sites": 2},
    {"inner_lr": 0.5},
    {"nesterov": False, "sites": 4},
    {"inner_lr": 0.5, "nesterov": False, "momentum": 0.5},
    {"inner_lr": 0.05, "local_steps": 20, "sites": 3, "nesterov": False, "momentum": 0.8},
]


@pytest.mark.parametrize("overrides", MC_CASES)
def test_monte_carlo_sign_matches_criterion(overrides: dict[str, float]) -> None:
    setup = replace(BASE, **overrides)
    gamma_star = max_stable_outer_lr(setup)
    inside = replace(setup, outer_lr=0.5 * gamma_star)
    outside = replace(setup, outer_lr=1.5 * gamma_star)
    assert check(inside).stable and not check(outside).stable
    assert monte_carlo_growth(inside, rounds=150, trials=2000, seed=7) < -0.02
    assert monte_carlo_growth(outside, rounds=150, trials=2000, seed=7) > 0.02


def test_monte_carlo_rate_matches_exact_recursion_when_noise_is_mild() -> None:
    # Mild noise (b = 8, M = 2): finite trials track E[x^2] itself, not only its sign.
    setup = replace(BASE, batch_size=8, sites=2)
    for factor in (0.5, 1.5):
        point = replace(setup, outer_lr=factor * max_stable_outer_lr(setup))
        expected = math.log(exact_second_moment_rate(point))
        assert monte_carlo_growth(point, rounds=150, trials=2000, seed=3) == pytest.approx(
            expected, abs=0.05
        )


def test_monte_carlo_is_reproducible_and_validates() -> None:
    assert monte_carlo_growth(BASE, rounds=20, trials=100, seed=5) == monte_carlo_growth(
        BASE, rounds=20, trials=100, seed=5
    )
    with pytest.raises(ValueError, match="rounds"):
        monte_carlo_growth(BASE, rounds=2, trials=10, seed=0)
    with pytest.raises(ValueError, match="trials"):
        monte_carlo_growth(BASE, rounds=10, trials=0, seed=0)


def test_check_spectrum_takes_the_binding_mode() -> None:
    modes = [
        replace(BASE, curvature=h, curvature_var=2 * h * h, inner_lr=0.1) for h in (0.1, 1.0, 5.0)
    ]
    per_mode = [max_stable_outer_lr(m) for m in modes]
    joint = check_spectrum(modes)
    assert joint.max_stable_outer_lr == min(per_mode)
    assert joint.stable == all(check(m).stable for m in modes)
    binding = modes[int(np.argmin(per_mode))]
    assert (joint.c, joint.V) == mode_moments(binding)
    between = sorted(per_mode)[0] * 1.05
    assert not check_spectrum([replace(m, outer_lr=between) for m in modes]).stable
    assert check_spectrum([replace(m, outer_lr=0.5 * min(per_mode)) for m in modes]).stable
    with pytest.raises(ValueError, match="at least one"):
        check_spectrum([])
    with pytest.raises(ValueError, match="outer_lr"):
        check_spectrum([BASE, replace(BASE, outer_lr=0.5)])


def test_verdict_fields_and_json() -> None:
    verdict = check(BASE)
    c, v = mode_moments(BASE)
    assert verdict.stable
    assert (verdict.c, verdict.V) == (c, v)
    assert verdict.u == pytest.approx(0.7 * c)
    assert verdict.w == pytest.approx(0.49 * v)
    assert verdict.u_limit == u_limit(0.9)
    assert verdict.w_limit == stability_limit(verdict.u, 0.9, True)
    data = verdict.to_dict()
    assert set(data) == {"stable", "max_stable_outer_lr", "c", "V", "u", "w", "u_limit", "w_limit"}
    assert type(data["stable"]) is bool
    assert all(type(val) is float for key, val in data.items() if key != "stable")
    assert json.loads(json.dumps(data)) == data
    with pytest.raises(AttributeError):
        verdict.stable = False  # type: ignore[misc]
    assert isinstance(verdict, StabilityVerdict)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("inner_lr", 0.0),
        ("inner_lr", float("nan")),
        ("curvature", -1.0),
        ("curvature_var", -0.1),
        ("batch_size", 0),
        ("batch_size", 2.0),
        ("local_steps", 0),
        ("sites", True),
        ("outer_lr", 0.0),
        ("momentum", 1.0),
        ("momentum", -0.1),
        ("nesterov", 1),
    ],
)
def test_validation_names_field_value_and_range(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        replace(BASE, **{field: value})
    message = str(info.value)
    assert repr(value) in message
    assert any(
        token in message for token in ("(0, inf)", "[0, inf)", "[0, 1)", ">= 1", "True or False")
    )


def test_plot_stable_region_writes_png(tmp_path) -> None:
    out = plot_stable_region(BASE, tmp_path / "nested" / "region.png")
    assert out == tmp_path / "nested" / "region.png"
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
    out_hb = plot_stable_region(
        replace(BASE, nesterov=False, sites=3), str(tmp_path / "hb.png"), sites=(1, 8)
    )
    assert out_hb.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_marker_colour_follows_verdict() -> None:
    verdict, colour = marker_style(BASE)
    assert verdict == check(BASE) and verdict.stable and colour == "green"
    unstable = replace(BASE, outer_lr=1.9)
    verdict, colour = marker_style(unstable)
    assert not verdict.stable and colour == "red"
