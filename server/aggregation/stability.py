"""Mean-square stability of DiLoCo-style outer momentum on a stochastic quadratic model.

Each of M sites starts a round at the shared x, runs H inner SGD steps (lr eta, batch b) on a mode of
curvature h whose per-sample curvature has variance v, and returns the pseudo-gradient Delta = C x.
C = 1 - prod_k(1 - eta * h_batch_k) averaged over sites has mean c and variance V, so one outer round
is a linear map with a random multiplicative coefficient. The outer optimizer is torch.optim.SGD:
    b_t = mu b_{t-1} + Delta_t;  x -= gamma (Delta_t + mu b_t)  (Nesterov)  or  x -= gamma b_t  (heavy ball).
Only u = gamma c and w = gamma^2 V matter. The closed-form criterion (see
shared/research/outer-nesterov-stability.md) is checked here against the exact 3x3 second-moment
recursion and a Monte-Carlo simulation, so the platform can warn before a run diverges.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path

import numpy as np

__all__ = [
    "OuterSetup",
    "StabilityVerdict",
    "check",
    "check_spectrum",
    "exact_second_moment_rate",
    "marker_style",
    "max_stable_outer_lr",
    "mode_moments",
    "moment_radius",
    "monte_carlo_growth",
    "plot_stable_region",
    "stability_limit",
    "u_limit",
]


def _require_real(
    name: str, value: object, *, low: float, low_open: bool, high: float | None = None
) -> None:
    """Reject non-finite numbers and values outside the given range, so a bad setup fails at construction."""
    upper = "inf)" if high is None else f"{high:g})"
    valid = f"{'(' if low_open else '['}{low:g}, {upper}"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number in {valid}, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value >= high):
        raise ValueError(f"{name} must be in {valid}, got {value!r}")


def _require_count(name: str, value: object) -> None:
    """Batch size, local steps and sites are counts: integers >= 1 (bool is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class OuterSetup:
    """One curvature mode (h, v) together with the inner and outer optimizer settings of a DiLoCo run."""

    inner_lr: float
    curvature: float
    curvature_var: float
    batch_size: int
    local_steps: int
    sites: int
    outer_lr: float
    momentum: float
    nesterov: bool = True

    def __post_init__(self) -> None:
        _require_real("inner_lr", self.inner_lr, low=0.0, low_open=True)
        _require_real("curvature", self.curvature, low=0.0, low_open=True)
        _require_real("curvature_var", self.curvature_var, low=0.0, low_open=False)
        _require_count("batch_size", self.batch_size)
        _require_count("local_steps", self.local_steps)
        _require_count("sites", self.sites)
        _require_real("outer_lr", self.outer_lr, low=0.0, low_open=True)
        _require_real("momentum", self.momentum, low=0.0, low_open=False, high=1.0)
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be a bool (True or False), got {self.nesterov!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class StabilityVerdict:
    """Outcome of the criterion with the quantities behind it, so a warning can say by how much."""

    stable: bool
    max_stable_outer_lr: float
    c: float
    V: float
    u: float
    w: float
    u_limit: float
    w_limit: float

    def to_dict(self) -> dict[str, bool | float]:
        """Plain bool/float values, ready for JSON run reports."""
        return {
            f.name: bool(getattr(self, f.name))
            if f.name == "stable"
            else float(getattr(self, f.name))
            for f in fields(self)
        }


def mode_moments(setup: OuterSetup) -> tuple[float, float]:
    """Mean c and variance V of the site-averaged pseudo-gradient coefficient C (Delta = C x).

    a = 1 - eta h, q = a^2 + eta^2 v / b, c = 1 - a^H, V = (q^H - a^(2H)) / M. For a > 0 the
    expm1/log1p forms keep c and V accurate when eta h or the noise is tiny.
    """
    eta, h, steps = setup.inner_lr, setup.curvature, setup.local_steps
    a = 1.0 - eta * h
    noise = eta * eta * setup.curvature_var / setup.batch_size
    if a > 0.0:
        c = -math.expm1(steps * math.log1p(-eta * h))
        spread = math.exp(2 * steps * math.log(a)) * math.expm1(steps * math.log1p(noise / (a * a)))
    else:
        c = 1.0 - a**steps
        spread = (a * a + noise) ** steps - a ** (2 * steps)
    return c, spread / setup.sites


def u_limit(mu: float, nesterov: bool = True) -> float:
    """Noise-free edge of u = gamma c: 2(1+mu)/(1+2mu) for Nesterov, 2(1+mu) for heavy ball."""
    return 2.0 * (1.0 + mu) / (1.0 + 2.0 * mu) if nesterov else 2.0 * (1.0 + mu)


def stability_limit(u: float, mu: float, nesterov: bool = True) -> float:
    """Largest tolerable noise W(u, mu): stable iff w < W. Zero outside 0 < u < u_limit, where nothing is stable.

    Nesterov: W = u (1 - mu + mu u)(2(1+mu) - (1+2mu) u) / (1 + mu + mu (1+2mu) u).
    Heavy ball: W = u (1 - mu)(2(1+mu) - u) / (1 + mu).
    """
    if not 0.0 < u < u_limit(mu, nesterov):
        return 0.0
    if nesterov:
        return (
            u
            * (1 - mu + mu * u)
            * (2 * (1 + mu) - (1 + 2 * mu) * u)
            / (1 + mu + mu * (1 + 2 * mu) * u)
        )
    return u * (1 - mu) * (2 * (1 + mu) - u) / (1 + mu)


def _max_stable_u(ratio: float, mu: float, nesterov: bool) -> float:
    """Edge u* of the stable interval (0, u*) in u for a fixed noise ratio r = V / c^2 (so w = r u^2).

    r u^2 < W(u) is, after clearing positive denominators, a quadratic (Nesterov) or linear (heavy ball)
    inequality with exactly one positive root, hence an interval:
        Nesterov:   (1+r) mu (1+2mu) u^2 + (r (1+mu) + 1 - mu - 4 mu^2) u - 2 (1 - mu^2) < 0
        heavy ball: u < 2 (1+mu)(1-mu) / (r (1+mu) + 1 - mu).
    """
    if not nesterov:
        return 2.0 * (1.0 + mu) * (1.0 - mu) / (ratio * (1.0 + mu) + 1.0 - mu)
    quad = (1.0 + ratio) * mu * (1.0 + 2.0 * mu)
    lin = ratio * (1.0 + mu) + 1.0 - mu - 4.0 * mu * mu
    const = 2.0 * (1.0 - mu * mu)
    root = math.sqrt(lin * lin + 4.0 * quad * const)
    # Pick the cancellation-free form of the positive root (also covers mu = 0, where quad = 0).
    return 2.0 * const / (lin + root) if lin >= 0.0 else (root - lin) / (2.0 * quad)


def max_stable_outer_lr(setup: OuterSetup) -> float:
    """Largest outer lr gamma* such that every gamma in (0, gamma*) is stable; 0.0 if the mode does not contract."""
    c, spread = mode_moments(setup)
    if not c > 0.0:
        return 0.0
    return _max_stable_u(spread / (c * c), setup.momentum, setup.nesterov) / c


def check(setup: OuterSetup) -> StabilityVerdict:
    """Apply the criterion to one mode: stable iff 0 < u < u_limit and w < W(u, mu)."""
    c, spread = mode_moments(setup)
    u = setup.outer_lr * c
    w = setup.outer_lr**2 * spread
    w_limit = stability_limit(u, setup.momentum, setup.nesterov)
    return StabilityVerdict(
        stable=w < w_limit,
        max_stable_outer_lr=max_stable_outer_lr(setup),
        c=c,
        V=spread,
        u=u,
        w=w,
        u_limit=u_limit(setup.momentum, setup.nesterov),
        w_limit=w_limit,
    )


def check_spectrum(setups: Sequence[OuterSetup]) -> StabilityVerdict:
    """Check several curvature modes of one run: stable iff every mode is; report the binding mode.

    The modes must share the outer optimizer (outer_lr, momentum, nesterov) because they are one run;
    max_stable_outer_lr is the minimum over modes and the other fields come from the mode attaining it.
    """
    if not setups:
        raise ValueError("setups must hold at least one mode, got an empty sequence")
    outer = {(s.outer_lr, s.momentum, s.nesterov) for s in setups}
    if len(outer) > 1:
        raise ValueError(f"setups must share outer_lr, momentum and nesterov, got {sorted(outer)}")
    verdicts = [check(s) for s in setups]
    binding = min(verdicts, key=lambda v: v.max_stable_outer_lr)
    return replace(binding, stable=all(v.stable for v in verdicts))


def _second_moment_map(u: float, w: float, mu: float, nesterov: bool) -> np.ndarray:
    """Exact linear map of (E x^2, E x B, E B^2) over one round, with B = gamma * momentum buffer.

    With g = gamma C (mean u, variance w, fresh each round) the state (x, B_prev) maps to
        Nesterov:   x' = (1 - (1+mu) g) x - mu^2 B,   B' = g x + mu B
        heavy ball: x' = (1 - g) x - mu B,            B' = g x + mu B
    i.e. x' = (1 + p g) x + beta B and B' = g x + mu B; E[(1 + p g)^2] etc. pick up the variance w.
    """
    p, beta = (-(1.0 + mu), -mu * mu) if nesterov else (-1.0, -mu)
    mean_x = 1.0 + p * u
    return np.array(
        [
            [mean_x * mean_x + p * p * w, 2.0 * mean_x * beta, beta * beta],
            [mean_x * u + p * w, mean_x * mu + beta * u, beta * mu],
            [u * u + w, 2.0 * u * mu, mu * mu],
        ]
    )


def moment_radius(u: float, w: float, mu: float, nesterov: bool = True) -> float:
    """Spectral radius of the exact second-moment map at (u, w): E x^2 grows iff it exceeds 1."""
    return float(np.max(np.abs(np.linalg.eigvals(_second_moment_map(u, w, mu, nesterov)))))


def exact_second_moment_rate(setup: OuterSetup) -> float:
    """Per-round factor rho by which E[x^2] eventually scales (ground truth for the criterion and Monte-Carlo)."""
    c, spread = mode_moments(setup)
    return moment_radius(
        setup.outer_lr * c, setup.outer_lr**2 * spread, setup.momentum, setup.nesterov
    )


def monte_carlo_growth(
    setup: OuterSetup, rounds: int = 200, trials: int = 4000, seed: int = 0
) -> float:
    """Simulate the model and return the per-round log growth rate of E[x^2] (its limit is log rho).

    Per-sample curvature is h + sqrt(v) * z with z ~ N(0, 1) (mean h, variance v; the criterion only
    sees these two moments). A batch of b such samples has Gaussian mean curvature h + sqrt(v / b) * z,
    drawn directly since it has exactly that law. Each trial is one run from x = 1 with an empty buffer;
    x is renormalised by the trial-mean of x^2 each round to avoid overflow, and the rate is the
    least-squares slope of log E[x^2] over the second half of the rounds. Note: with heavy multiplicative
    noise a finite number of trials drifts towards the typical (Lyapunov) rate, which is below log rho.
    """
    _require_count("rounds", rounds)
    _require_count("trials", trials)
    if rounds < 4:
        raise ValueError(f"rounds must be an integer >= 4 to fit a slope, got {rounds!r}")
    rng = np.random.default_rng(seed)
    eta, gamma, mu = setup.inner_lr, setup.outer_lr, setup.momentum
    batch_sd = math.sqrt(setup.curvature_var / setup.batch_size)
    x = np.ones(trials)
    buf = np.zeros(trials)
    log_ms = np.empty(rounds)
    log_scale = 0.0
    for t in range(rounds):
        local = np.broadcast_to(x[:, None], (trials, setup.sites)).copy()
        for _ in range(setup.local_steps):
            h_batch = setup.curvature + batch_sd * rng.standard_normal((trials, setup.sites))
            local -= eta * h_batch * local
        delta = x - local.mean(axis=1)
        buf = mu * buf + delta
        x = x - gamma * (delta + mu * buf) if setup.nesterov else x - gamma * buf
        mean_sq = float(np.mean(x * x))
        if not mean_sq > 0.0 or not math.isfinite(mean_sq):
            raise FloatingPointError(f"E[x^2] left the float range at round {t}: {mean_sq!r}")
        log_scale += math.log(mean_sq)
        log_ms[t] = log_scale
        scale = math.sqrt(mean_sq)
        x /= scale
        buf /= scale
    tail = np.arange(rounds // 2, rounds)
    return float(np.polyfit(tail, log_ms[tail], 1)[0])


def marker_style(setup: OuterSetup) -> tuple[StabilityVerdict, str]:
    """Verdict for the setup's own (gamma, mu) point and the marker colour it gets in the plot."""
    verdict = check(setup)
    return verdict, "green" if verdict.stable else "red"


def plot_stable_region(
    setup: OuterSetup, path: str | os.PathLike[str], *, sites: Sequence[int] = (1, 2, 4, 8, 16)
) -> Path:
    """Write a PNG of the stable region in the (outer lr gamma, momentum mu) plane and return its path.

    The setup's own number of sites is shaded; each entry of `sites` gets its boundary gamma*(mu);
    the setup's point is green when stable, red when not.
    """
    mus = np.linspace(0.0, 0.99, 199)

    def edge(n_sites: int) -> np.ndarray:
        return np.array(
            [max_stable_outer_lr(replace(setup, sites=n_sites, momentum=float(m))) for m in mus]
        )

    curves = {n: edge(n) for n in sites}
    own = curves[setup.sites] if setup.sites in curves else edge(setup.sites)
    verdict, colour = marker_style(setup)
    gamma_max = 1.1 * max(
        [setup.outer_lr, float(own.max()), *(float(c.max()) for c in curves.values())]
    )

    from matplotlib.backends.backend_agg import (
        FigureCanvasAgg,
    )  # only plotting needs it, not the coordinator
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.0, 5.0), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.fill_betweenx(
        mus, 0.0, own, color="tab:green", alpha=0.18, label=f"stable (M={setup.sites})"
    )
    for n_sites, curve in curves.items():
        ax.plot(curve, mus, lw=1.5, label=f"edge M={n_sites}")
    ax.plot(
        [setup.outer_lr],
        [setup.momentum],
        marker="o",
        ms=9,
        color=colour,
        mec="black",
        ls="none",
        label=f"setup ({'stable' if verdict.stable else 'unstable'})",
    )
    ax.set_xlim(0.0, gamma_max)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("outer learning rate $\\gamma$")
    ax.set_ylabel("outer momentum $\\mu$")
    kind = "Nesterov" if setup.nesterov else "heavy-ball"
    ax.set_title(
        f"Stable outer {kind} region: eta={setup.inner_lr:g}, h={setup.curvature:g}, "
        f"v={setup.curvature_var:g}, b={setup.batch_size}, H={setup.local_steps}",
        fontsize=10,
    )
    ax.legend(loc="lower left", fontsize=8)
    ax.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
