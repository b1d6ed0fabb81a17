"""The FedBuff buffer's weights, one component both FedBuff strategies hold: each update's staleness factor, the
truncation cap, and the effective-sample-size guard, computed as updates arrive so the buffer streams.

An update that started from model version v and arrives at version V has staleness tau = V - v. Its weight is
w = min(s(tau) * n / n_mean, cap): s(tau) = 1/sqrt(1+tau) or (1+tau)^-a (Nguyen et al., "Federated Learning with
Buffered Asynchronous Aggregation", 2022), n its example count and n_mean the mean example count of every
update folded so far (equal sites weigh s(tau)). The buffer's step is sum_i w_i delta_i / K, the paper's 1/K
normalisation, so stale buffers take smaller steps. The guard measures how many sites the buffer really
averages, ESS = (sum_s W_s)^2 / sum_s W_s^2 over the per-site weight sums W_s (a fast site that filled the buffer
alone counts once), and below `ess_min` skips the buffer or shrinks its step by ESS / ess_min.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hydrafl.validation import check

STALENESS_RULES = ("sqrt", "poly")
ESS_ACTIONS = ("skip", "shrink")


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferRule:
    """How a buffer of K updates weighs them and when it steps."""

    buffer_size: int = 2
    staleness: str = "sqrt"
    staleness_exponent: float = 0.5
    weight_cap: float = 0.0
    """0: no cap."""
    ess_min: float = 0.0
    """0: no guard."""
    ess_action: str = "shrink"

    def factor(self, tau: int) -> float:
        """s(tau): 1/sqrt(1+tau) or (1+tau)^-a."""
        if tau < 0:
            raise ValueError(f"staleness must be >= 0, got {tau}")
        exponent = 0.5 if self.staleness == "sqrt" else self.staleness_exponent
        return (1.0 + tau) ** -exponent


@dataclass(frozen=True, kw_only=True, slots=True)
class BufferReport:
    """What one flushed buffer was: each update's staleness and weight, its ESS and the scale its step took
    (sum w / K, times the guard's shrink; 0 when skipped)."""

    nodes: list[int]
    staleness: list[int]
    weights: list[float]
    ess: float
    scale: float

    @property
    def skipped(self) -> bool:
        return self.scale == 0.0


@dataclass(kw_only=True, slots=True)
class StalenessBuffer:
    """The weights of the updates in the current buffer, and the running example count behind n_mean."""

    rule: BufferRule
    nodes: list[int] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    examples_seen: float = 0.0
    updates_seen: int = 0

    def weigh(self, node: int, tau: int, num_examples: float) -> float:
        """The weight of an update arriving now (and it joins the buffer)."""
        if num_examples <= 0:
            raise ValueError(f"an update needs a positive example count, got {num_examples}")
        self.examples_seen += num_examples
        self.updates_seen += 1
        weight = self.rule.factor(tau) * num_examples * self.updates_seen / self.examples_seen
        if self.rule.weight_cap:
            weight = min(weight, self.rule.weight_cap)
        self.nodes.append(node)
        self.staleness.append(tau)
        self.weights.append(weight)
        return weight

    @property
    def full(self) -> bool:
        return len(self.weights) >= self.rule.buffer_size

    def flush(self) -> BufferReport:
        """The buffer's report, and an empty buffer for the next one."""
        effective = ess(self.nodes, self.weights)
        scale = sum(self.weights) / len(
            self.weights
        )  # sum w / K: the weighted mean delta times this is sum w delta / K
        if effective < self.rule.ess_min:
            scale = 0.0 if self.rule.ess_action == "skip" else scale * effective / self.rule.ess_min
        report = BufferReport(
            nodes=self.nodes,
            staleness=self.staleness,
            weights=self.weights,
            ess=effective,
            scale=scale,
        )
        self.nodes, self.staleness, self.weights = [], [], []
        return report

    def state_dict(self) -> dict[str, Any]:
        return {"examples_seen": self.examples_seen, "updates_seen": self.updates_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.examples_seen, self.updates_seen = state["examples_seen"], state["updates_seen"]
        self.nodes, self.staleness, self.weights = [], [], []


def ess(nodes: list[int], weights: list[float]) -> float:
    """(sum_s W_s)^2 / sum_s W_s^2 over the per-site sums W_s of `weights`: 1 when one site holds it all."""
    per_site: dict[int, float] = {}
    for node, weight in zip(nodes, weights, strict=True):
        per_site[node] = per_site.get(node, 0.0) + weight
    squares = sum(w * w for w in per_site.values())
    return sum(per_site.values()) ** 2 / squares if squares > 0 else 0.0


def check_rule(rule: BufferRule) -> None:
    """ConfigError naming the knob when `rule` cannot run."""
    check(
        rule.buffer_size >= 1,
        "buffer-size",
        rule.buffer_size,
        "an integer >= 1 (K updates per step)",
    )
    check(
        rule.staleness in STALENESS_RULES, "staleness", rule.staleness, ", ".join(STALENESS_RULES)
    )
    check(rule.staleness_exponent > 0, "staleness-exponent", rule.staleness_exponent, "a float > 0")
    check(
        rule.weight_cap >= 0 and math.isfinite(rule.weight_cap),
        "weight-cap",
        rule.weight_cap,
        "0 (off) or a float > 0",
    )
    check(
        rule.ess_min == 0 or 1 <= rule.ess_min <= rule.buffer_size,
        "ess-min",
        rule.ess_min,
        f"0 (off) or 1..buffer-size ({rule.buffer_size})",
    )
    check(rule.ess_action in ESS_ACTIONS, "ess-action", rule.ess_action, ", ".join(ESS_ACTIONS))
