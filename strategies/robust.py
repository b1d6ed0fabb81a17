"""Robust aggregation that respects masks: the coordinate-wise median and trimmed mean of the sites' deltas, each
coordinate over only the sites that trained it (Yin et al., 2018, "Byzantine-Robust Distributed Learning"), and
the norm-clipped mean.

A subnetwork strategy's sites train different coordinates, so the dense rules (Flower's FedMedian and
FedTrimmedAvg) do not apply: a site that did not train a coordinate has no value there, not a zero. Here a
coordinate trained by k sites takes the median of those k values (the mean of the two middle ones when k is
even, as numpy's), or their mean after cutting max(1, floor(beta k)) values at each end once k >= 3 (floor
alone cuts nothing below k = 1 / beta, so a tiered layer trained by 3 or 4 sites would take a plain mean); a
coordinate no site trained keeps its value. A coordinate trained by one or two sites has no majority to protect
it (the median of two values is their mean; nothing can be trimmed): `aggregate` counts those coordinates
(`unprotected`) and logs the count, and only screening (`hydrafl.server.aggregation.screening`) keeps an
outlier out there.

clipped-mean (norm bounding; a one-step, zero-centred form of centred clipping, Karimireddy et al., ICML 2021):
each site's whole update is scaled down to at most `clip_factor` x the round's median size, then the masked
mean is taken. The size is the update's RMS over the coordinates it carries (its L2 norm / sqrt(their count)),
so a site of a small tier is not judged by its smaller norm; when every site trains everything, this is
clipping to the median norm. It bounds what one site moves (a 100x scaled update, random noise) whatever k is,
and keeps every honest value, where the median and the trimmed mean drop some; it does nothing against an
attacker of ordinary size (a sign flip, a small inner-product push).
Every site counts once under every rule (sample counts are ignored: a hostile site could inflate its own).

What it costs: no rule here can stream, so the round's replies are held (their compact slices, O(sites x
model)); aggregation then goes one tensor at a time, stacking that tensor's values over the sites (NaN where a
site did not train a coordinate) and sorting along the sites, so the extra memory is one tensor times the
number of sites, and the time O(sites log sites) per coordinate.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from hydrafl.strategies.registry import StrategyConfig
from hydrafl.subnet.slices import Slice
from hydrafl.validation import check

ROBUST_RULES = ("mean", "median", "trimmed-mean", "clipped-mean")
MAJORITY_SITES = 3
"""The fewest sites on a coordinate for the median or a trimmed mean to outvote one outlier."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class RobustRule:
    """Which rule combines a coordinate's values over the sites that trained it."""

    name: str = "mean"
    trim_fraction: float = 0.2
    clip_factor: float = 1.0

    def __post_init__(self) -> None:
        check(self.name in ROBUST_RULES, "robust-rule", self.name, ", ".join(ROBUST_RULES))
        check(
            0 <= self.trim_fraction < 0.5,
            "trim-fraction",
            self.trim_fraction,
            "a fraction in [0, 0.5)",
        )
        check(
            self.clip_factor > 0,
            "clip-factor",
            self.clip_factor,
            "a positive multiple of the median size",
        )

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
    """Aggregation over the sites that trained each coordinate: mean (streamed), median, trimmed-mean or
    clipped-mean (the round's replies are held, O(sites x model) memory); every site counts once under the
    robust rules."""
    trim_fraction: float = 0.2
    """trimmed-mean: the fraction of a coordinate's values cut at each end: max(1, floor(beta k)) of its k sites
    once k >= 3 (beta > 0), none below."""
    clip_factor: float = 1.0
    """clipped-mean: each site's update is scaled down to at most this many times the round's median RMS per
    coordinate (1: the median norm when every site trains everything), then the masked mean is taken."""

    def __post_init__(self) -> None:
        self.rule()  # checks both knobs
        check(
            not self.refuses_robust_rule or self.robust_rule == "mean",
            "robust-rule",
            self.robust_rule,
            f"mean: {self.refuses_robust_rule}",
        )

    def rule(self) -> RobustRule:
        return RobustRule(
            name=self.robust_rule, trim_fraction=self.trim_fraction, clip_factor=self.clip_factor
        )


class MaskedRobustAggregator:
    """Collects each site's compact slices of each tensor; `aggregate` applies the rule one tensor at a time."""

    def __init__(self, rule: RobustRule) -> None:
        self.rule = rule
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.parts: dict[str, list[tuple[int, Slice, torch.Tensor]]] = {}
        self.sites = 0
        """Replies added whole by `add_slices`; the next one is site number `sites`."""
        self.unprotected: dict[str, int] = {}
        """After `aggregate` (median, trimmed-mean): per tensor, its coordinates trained by only 1 or 2 sites."""

    def add(
        self,
        name: str,
        sl: Slice,
        values: torch.Tensor,
        shape: tuple[int, ...],
        site: int | None = None,
    ) -> None:
        """One site's values for the coordinates `sl` of the tensor `name` of full `shape` (`Slice.take`'s shape).
        `site` numbers the sender (clipped-mean sizes each site's whole update); by default the i-th value added
        under `name` is site i, right when every site sends every tensor."""
        expected = sl.taken_shape(shape)
        if tuple(values.shape) != expected:
            raise ValueError(
                f"array {name!r}: values of shape {tuple(values.shape)}, its slice is {expected}"
            )
        if self.shapes.setdefault(name, tuple(shape)) != tuple(shape):
            raise ValueError(
                f"array {name!r}: full shape {tuple(shape)}, earlier {self.shapes[name]}"
            )
        parts = self.parts.setdefault(name, [])
        parts.append((len(parts) if site is None else site, sl, values))

    def add_slices(
        self,
        arrays: Mapping[str, torch.Tensor],
        slices: Mapping[str, Slice],
        shapes: Mapping[str, tuple[int, ...]],
    ) -> None:
        """A whole reply: its compact tensors, each with its slice of the global tensor of that name."""
        for name, values in arrays.items():
            self.add(name, slices[name], values, shapes[name], site=self.sites)
        self.sites += 1

    def aggregate(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per name: (the rule's value, 0 where no site trained; bool mask of trained coordinates)."""
        scale = self._clip_scales() if self.rule.name == "clipped-mean" else {}
        out = {}
        for name, parts in self.parts.items():
            stacked = torch.full(
                (len(parts), *self.shapes[name]), math.nan, dtype=torch.float32
            )  # [sites, *shape]
            for row, (site, sl, values) in zip(stacked, parts, strict=True):
                _fill(row, sl, values.to(torch.float32) * scale.get(site, 1.0))
            if self.rule.name == "clipped-mean":
                out[name] = masked_trimmed_mean(stacked, 0.0)
                continue
            count = (~torch.isnan(stacked)).sum(0)
            self.unprotected[name] = int(((count > 0) & (count < MAJORITY_SITES)).sum())
            out[name] = (
                masked_median(stacked)
                if self.rule.name == "median"
                else masked_trimmed_mean(stacked, self.rule.trim_fraction)
            )
        if thin := sum(self.unprotected.values()):
            covered = sum(int(c.sum()) for _, c in out.values())
            log.warning(
                "%s: %d of %d trained coordinates had only 1 or 2 sites (no majority: their plain mean, "
                "nothing trimmed); only screening guards them",
                self.rule.name,
                thin,
                covered,
            )
        return out

    def _clip_scales(self) -> dict[int, float]:
        """Per site: min(1, clip_factor x the median RMS / its RMS), the RMS over every coordinate it sent."""
        squares: dict[int, float] = {}
        sizes: dict[int, int] = {}
        for parts in self.parts.values():
            for site, _, values in parts:
                squares[site] = squares.get(site, 0.0) + float(
                    values.to(torch.float64).square().sum()
                )
                sizes[site] = sizes.get(site, 0) + values.numel()
        rms = {site: math.sqrt(squares[site] / max(sizes[site], 1)) for site in squares}
        limit = (
            self.rule.clip_factor * statistics.median(rms.values()) if rms else 0.0
        )  # even: middle two's mean
        return {site: min(1.0, limit / r) if r > 0 else 1.0 for site, r in rms.items()}


def masked_median(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 (sites), NaN = not trained: each coordinate's median over its own sites (mean of the two
    middle values for an even count), 0 where none trained; and the mask of trained coordinates."""
    ordered, count = _sorted(stacked)
    low = ((count - 1).clamp(min=0) // 2).unsqueeze(0)
    high = (count // 2).clamp(max=stacked.shape[0] - 1).unsqueeze(0)
    median = (ordered.gather(0, low) + ordered.gather(0, high)).squeeze(0) / 2
    covered = count > 0
    return torch.where(covered, median, 0.0), covered


def trim_counts(count: torch.Tensor, beta: float) -> torch.Tensor:
    """Values cut at each end of a coordinate with `count` values: floor(beta k), at least 1 once k >= 3 (beta > 0:
    beta 0 is the plain mean); beta < 0.5 keeps at least one value."""
    cut = torch.floor(count.to(torch.float64) * beta).to(count.dtype)
    return torch.where((count >= MAJORITY_SITES) & (beta > 0), cut.clamp(min=1), cut)


def masked_trimmed_mean(stacked: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Over dim 0 (sites), NaN = not trained: each coordinate's mean after cutting `trim_counts` of its own k
    values at each end, 0 where none trained; and the mask of trained coordinates."""
    ordered, count = _sorted(stacked)
    cut = trim_counts(count, beta)
    rank = torch.arange(stacked.shape[0]).view(-1, *([1] * (stacked.dim() - 1)))  # [sites, 1, ...]
    kept = (rank >= cut) & (rank < count - cut)
    total = torch.where(kept, ordered, 0.0).sum(0)
    covered = count > 0
    return torch.where(covered, total / (count - 2 * cut).clamp(min=1), 0.0), covered


def _sorted(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Values sorted along the sites with the NaNs (untrained) last, and each coordinate's count of values."""
    count = (~torch.isnan(stacked)).sum(0)
    ordered, _ = torch.sort(
        torch.nan_to_num(stacked, nan=math.inf), dim=0
    )  # NaN as +inf: sorted last, never read
    return ordered, count


def _fill(row: torch.Tensor, sl: Slice, values: torch.Tensor) -> None:
    """row[slice] = values, in place."""
    if sl.dim is None:
        row.copy_(values)
    else:
        row.index_copy_(sl.dim, torch.tensor(sl.index, dtype=torch.long), values)
