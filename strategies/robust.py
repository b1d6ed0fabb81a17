"""Robust aggregation that respects masks: the coordinate-wise median and trimmed mean of the sites' deltas, each
coordinate over only the sites that trained it (Yin et al., 2018, "Byzantine-Robust Distributed Learning").

A subnetwork strategy's sites train different coordinates, so the dense rules (Flower's FedMedian and
FedTrimmedAvg) do not apply: a site that did not train a coordinate has no value there, not a zero. Here a
coordinate trained by n_k sites takes the median of those n_k values (the mean of the two middle ones when n_k
is even, as numpy's), or their mean after cutting floor(beta n_k) values at each end; a coordinate no site
trained keeps its value. Every site counts once (sample counts are ignored: a hostile site could inflate its
own). A coordinate trained by one or two sites has no majority to protect it (the median of two values is
their mean): there, only screening (`hydrafl.screening`, the run's `screen_norm`) keeps an outlier out.

What it costs: neither rule can stream, so the round's replies are held (their compact slices, O(sites x
model)); aggregation then goes one tensor at a time, stacking that tensor's values over the sites (NaN where a
site did not train a coordinate) and sorting along the sites, so the extra memory is one tensor times the
number of sites, and the time O(sites log sites) per coordinate.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from hydrafl.strategies.registry import StrategyConfig
from hydrafl.subnet.slices import Slice
from hydrafl.validation import check

ROBUST_RULES = ("mean", "median", "trimmed-mean")


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustRule:
    """Which rule combines a coordinate's values over the sites that trained it."""

    name: str = "mean"
    trim_fraction: float = 0.2

    def __post_init__(self) -> None:
        check(self.name in ROBUST_RULES, "robust-rule", self.name, ", ".join(ROBUST_RULES))
        check(0 <= self.trim_fraction < 0.5, "trim-fraction", self.trim_fraction, "a fraction in [0, 0.5)")

    @property
    def robust(self) -> bool:
        """False for the plain mean, which the strategies stream instead."""
        return self.name != "mean"


@dataclass(frozen=True, kw_only=True)
class RobustConfig(StrategyConfig):
    """The robust-rule knobs of the strategies whose aggregation is a masked sum."""

    refuses_robust_rule: ClassVar[str] = ""
    """Why a strategy cannot take a robust rule (its aggregate is not a per-coordinate sum); empty: it can."""
    robust_rule: str = "mean"
    """Aggregation over the sites that trained each coordinate: mean (streamed), median or trimmed-mean (the
    round's replies are held, O(sites x model) memory); every site counts once under the robust rules."""
    trim_fraction: float = 0.2
    """trimmed-mean: the fraction of a coordinate's values cut at each end (floor(beta n) of its n sites)."""

    def __post_init__(self) -> None:
        self.rule()  # checks both knobs
        check(
            not self.refuses_robust_rule or self.robust_rule == "mean", "robust-rule", self.robust_rule,
            f"mean: {self.refuses_robust_rule}",
        )

    def rule(self) -> RobustRule:
        return RobustRule(name=self.robust_rule, trim_fraction=self.trim_fraction)


class MaskedRobustAggregator:
    """Collects each site's compact slices of each tensor; `aggregate` applies the rule one tensor at a time."""

    def __init__(self, rule: RobustRule) -> None:
        self.rule = rule
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.parts: dict[str, list[tuple[Slice, torch.Tensor]]] = {}

    def add(self, name: str, sl: Slice, values: torch.Tensor, shape: tuple[int, ...]) -> None:
        """One site's values for the coordinates `sl` of the tensor `name` of full `shape` (`Slice.take`'s shape)."""
        expected = sl.taken_shape(shape)
        if tuple(values.shape) != expected:
            raise ValueError(f"array {name!r}: values of shape {tuple(values.shape)}, its slice is {expected}")
        if self.shapes.setdefault(name, tuple(shape)) != tuple(shape):
            raise ValueError(f"array {name!r}: full shape {tuple(shape)}, earlier {self.shapes[name]}")
        self.parts.setdefault(name, []).append((sl, values))

    def add_slices(self, arrays: Mapping[str, torch.Tensor], slices: Mapping[str, Slice],
                   shapes: Mapping[str, tuple[int, ...]]) -> None:
        """A whole reply: its compact tensors, each with its slice of the global tensor of that name."""
        for name, values in arrays.items():
            self.add(name, slices[name], values, shapes[name])

    def aggregate(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per name: (the rule's value, 0 where no site trained; bool mask of trained coordinates)."""
        out = {}
        for name, parts in self.parts.items():
            stacked = torch.full((len(parts), *self.shapes[name]), math.nan, dtype=torch.float32)  # [sites, *shape]
            for row, (sl, values) in zip(stacked, parts, strict=True):
                _fill(row, sl, values.to(torch.float32))
            out[name] = masked_median(stacked) if self.rule.name == "median" else masked_trimmed_mean(
                stacked, self.rule.trim_fraction
            )
        return out


def masked_median(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 (sites), NaN = not trained: each coordinate's median over its own sites (mean of the two
    middle values for an even count), 0 where none trained; and the mask of trained coordinates."""
    ordered, count = _sorted(stacked)
    low = ((count - 1).clamp(min=0) // 2).unsqueeze(0)
    high = (count // 2).clamp(max=stacked.shape[0] - 1).unsqueeze(0)
    median = (ordered.gather(0, low) + ordered.gather(0, high)).squeeze(0) / 2
    covered = count > 0
    return torch.where(covered, median, 0.0), covered


def masked_trimmed_mean(stacked: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 (sites), NaN = not trained: each coordinate's mean after cutting floor(beta n) of its own n
    values at each end, 0 where none trained; and the mask of trained coordinates."""
    ordered, count = _sorted(stacked)
    cut = torch.floor(count.to(torch.float64) * beta).to(count.dtype)
    rank = torch.arange(stacked.shape[0]).view(-1, *([1] * (stacked.dim() - 1)))  # [sites, 1, ...]
    kept = (rank >= cut) & (rank < count - cut)
    total = torch.where(kept, ordered, 0.0).sum(0)
    covered = count > 0
    return torch.where(covered, total / (count - 2 * cut).clamp(min=1), 0.0), covered


def _sorted(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values sorted along the sites with the NaNs (untrained) last, and each coordinate's count of values."""
    count = (~torch.isnan(stacked)).sum(0)
    ordered, _ = torch.sort(torch.nan_to_num(stacked, nan=math.inf), dim=0)  # NaN as +inf: sorted last, never read
    return ordered, count


def _fill(row: torch.Tensor, sl: Slice, values: torch.Tensor) -> None:
    """row[slice] = values, in place."""
    if sl.dim is None:
        row.copy_(values)
    else:
        row.index_copy_(sl.dim, torch.tensor(sl.index, dtype=torch.long), values)
