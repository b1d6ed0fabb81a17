"""Federated statistics of the cohorts before training: what a site reports, how its policy releases it, and how
the coordinator adds the sites' reports up.

A site counts (`SiteStats`): its records; its records per label (and, for images, per size); per feature a
histogram on the run's bin edges (`StatsConfig`: from the run, never from the data, so the edges reveal
nothing) and the values that are missing (not finite); its texts' token lengths and vocabulary size; its images'
channel means. Every number is a count of records, so the site's policy releases it as counts are released
(`release`): noised first if it asks (Laplace or Gaussian), then cells of 1 to min-cell-count - 1 suppressed
(a cell of 0 discloses no one). The coordinator adds the released counts up (`combine`); quantiles come from a
histogram, and lie within one bin width of the data's own (`histogram_quantile`).

Accounting: one record moves each group of cells (the record count; one category's counts; one feature's
histogram with its missing cell; a channel's histogram) in one cell by 1, and the vocabulary size by up to the
distinct tokens one text holds. A release splits its epsilon (and delta) equally over its groups, so by basic
composition the report is (epsilon, delta)-DP for any one record of the site; the sites' records are disjoint,
so the combined table is too.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Cell = int | None
"""A released count; None where the site suppressed it."""
MECHANISMS = ("laplace", "gaussian")
MAX_REPORT_CHARS = 1 << 20
"""The largest report a coordinator reads from a site (JSON characters)."""
QUANTILES = (0.05, 0.25, 0.5, 0.75, 0.95)


class StatsError(ValueError):
    """A report that cannot be released or read; the message says which part and why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Histogram:
    """Counts on `edges`: the open bin below edges[0], one per [edges[i], edges[i+1]), the open bin from
    edges[-1] up."""

    edges: tuple[float, ...]
    counts: tuple[Cell, ...]

    @property
    def width(self) -> float:
        """The widest inner bin: the error bound of a quantile that falls inside the edges."""
        return max(b - a for a, b in zip(self.edges, self.edges[1:], strict=False))


@dataclass(frozen=True, kw_only=True, slots=True)
class Release:
    """How a site released its report."""

    min_cell_count: int = 0
    mechanism: str = ""
    """laplace, gaussian or "" (no noise)."""
    epsilon: float = 0.0
    delta: float = 0.0
    suppressed: int = 0
    """Cells the site suppressed."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteStats:
    modality: str
    records: Cell
    categories: dict[str, dict[str, Cell]] = field(default_factory=dict)
    """Per category (label; image size), records per value."""
    histograms: dict[str, Histogram] = field(default_factory=dict)
    missing: dict[str, Cell] = field(default_factory=dict)
    """Per feature histogram, the records whose value is missing (counted in no bin)."""
    vocabulary: Cell = None
    """Texts: distinct token ids."""
    vocabulary_sensitivity: int = 0
    """Texts: the most distinct tokens one record holds (how far one record moves `vocabulary`)."""
    release: Release = field(default_factory=Release)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SiteStats:
        """A site's report, checked field by field (it comes from outside)."""
        if not isinstance(text, str) or len(text) > MAX_REPORT_CHARS:
            raise StatsError(
                f"a statistics report is a JSON text of at most {MAX_REPORT_CHARS} characters"
            )
        try:
            raw = json.loads(text)
            return cls(
                modality=_name(raw["modality"]),
                records=_cell(raw["records"]),
                categories={
                    _name(name): {_name(k): _cell(v) for k, v in _items(values)}
                    for name, values in _items(raw["categories"])
                },
                histograms={
                    _name(name): _histogram(value) for name, value in _items(raw["histograms"])
                },
                missing={_name(k): _cell(v) for k, v in _items(raw["missing"])},
                vocabulary=_cell(raw["vocabulary"]),
                vocabulary_sensitivity=_count(raw["vocabulary_sensitivity"]),
                release=Release(**_release(raw["release"])),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise StatsError(f"not a statistics report: {error}") from None


def count_histogram(values: np.ndarray, edges: Sequence[float]) -> tuple[int, ...]:
    """Counts of the finite `values` in the bins of `edges` (`Histogram`'s layout)."""
    finite = values[np.isfinite(values)]
    index = np.searchsorted(np.asarray(edges, dtype=np.float64), finite, side="right")
    return tuple(int(n) for n in np.bincount(index, minlength=len(edges) + 1))


def shared_edges(low: float, high: float, bins: int) -> tuple[float, ...]:
    return tuple(float(edge) for edge in np.linspace(low, high, bins + 1))


def release(
    stats: SiteStats,
    *,
    min_cell_count: int = 0,
    mechanism: str = "",
    epsilon: float = 0.0,
    delta: float = 0.0,
    rng: np.random.Generator | None = None,
) -> SiteStats:
    """`stats` as they may leave the site: with `mechanism`, every count noised (rounded, at least 0) for
    (`epsilon`, `delta`) in all; then every cell of 1 to `min_cell_count` - 1 suppressed, and in a group (a
    category's counts; a histogram with its missing cell) left with one suppressed cell, its smallest other
    non-zero cell too (`_complement`). Noise is drawn in the report's order: records, categories, histograms,
    missing cells, vocabulary."""
    groups = 1 + len(stats.categories) + len(stats.histograms) + (stats.vocabulary is not None)
    noise = _noise(mechanism, epsilon / groups, delta / groups, rng) if mechanism else None
    suppressed = 0

    def cell(value: Cell, sensitivity: int = 1) -> Cell:
        nonlocal suppressed
        if value is None:
            return None
        if noise is not None:
            value = max(0, round(value + noise(sensitivity)))
        if 0 < value < min_cell_count:
            suppressed += 1
            return None
        return value

    records = cell(stats.records)
    categories = {
        name: {key: cell(value) for key, value in values.items()}
        for name, values in stats.categories.items()
    }
    histograms = {
        name: dataclasses.replace(histogram, counts=tuple(cell(c) for c in histogram.counts))
        for name, histogram in stats.histograms.items()
    }
    missing = {name: cell(value) for name, value in stats.missing.items()}
    vocabulary = cell(stats.vocabulary, max(stats.vocabulary_sensitivity, 1))
    for name, values in categories.items():
        kept = _complement(list(values.values()))
        suppressed += sum(
            a is not None and b is None for a, b in zip(values.values(), kept, strict=True)
        )
        categories[name] = dict(zip(values, kept, strict=True))
    for name, histogram in histograms.items():
        group = [*histogram.counts, *([missing[name]] if name in missing else [])]
        kept = _complement(group)
        suppressed += sum(a is not None and b is None for a, b in zip(group, kept, strict=True))
        histograms[name] = dataclasses.replace(
            histogram, counts=tuple(kept[: len(histogram.counts)])
        )
        if name in missing:
            missing[name] = kept[-1]
    return dataclasses.replace(
        stats,
        records=records,
        categories=categories,
        histograms=histograms,
        missing=missing,
        vocabulary=vocabulary,
        release=Release(
            min_cell_count=min_cell_count,
            mechanism=mechanism,
            epsilon=epsilon if mechanism else 0.0,
            delta=delta if mechanism == "gaussian" else 0.0,
            suppressed=suppressed,
        ),
    )


def _complement(cells: list[Cell]) -> list[Cell]:
    """Secondary suppression: the cells of a group add up to the site's records, so one suppressed cell would be
    the records less the others; with exactly one suppressed, the smallest other non-zero cell goes too."""
    if sum(value is None for value in cells) != 1:
        return cells
    shown = [(value, index) for index, value in enumerate(cells) if value]
    if not shown:
        return cells
    _, index = min(shown)
    return [None if i == index else value for i, value in enumerate(cells)]


def noise_scale(mechanism: str, sensitivity: float, epsilon: float, delta: float) -> float:
    """Laplace: the scale b = sensitivity / epsilon; Gaussian: the std of the classic mechanism,
    sensitivity x sqrt(2 ln(1.25 / delta)) / epsilon (valid for epsilon < 1)."""
    if mechanism == "laplace":
        return sensitivity / epsilon
    return sensitivity * math.sqrt(2 * math.log(1.25 / delta)) / epsilon


def _noise(mechanism: str, epsilon: float, delta: float, rng: np.random.Generator | None) -> Any:
    if mechanism not in MECHANISMS:
        raise StatsError(f"noise {mechanism!r}: choose {' or '.join(MECHANISMS)}")
    if not epsilon > 0:
        raise StatsError("a noised release needs an epsilon > 0")
    if mechanism == "gaussian" and not (epsilon < 1 and 0 < delta < 1):
        raise StatsError(
            f"the Gaussian mechanism needs each group's epsilon below 1 (here {epsilon:.3g}) and a delta in "
            "(0, 1); lower stats-epsilon or use laplace"
        )
    generator = rng if rng is not None else np.random.default_rng()

    def draw(sensitivity: int) -> float:
        scale = noise_scale(mechanism, sensitivity, epsilon, delta)
        if mechanism == "laplace":
            return float(generator.laplace(0.0, scale))
        return float(generator.normal(0.0, scale))

    return draw


def histogram_quantile(histogram: Histogram, q: float) -> float | None:
    """The q-quantile of the counted values (the smallest value with at least q of them at or below it),
    interpolated in the bin that holds it: within `histogram.width` of the data's own. -inf or inf when it falls
    in an open bin; None without counts. Suppressed cells count as 0."""
    counts = [c or 0 for c in histogram.counts]
    total = sum(counts)
    if not total:
        return None
    rank = max(1, math.ceil(q * total))
    below = 0
    for index, count in enumerate(counts):
        if below + count >= rank:
            if index == 0:
                return -math.inf
            if index == len(counts) - 1:
                return math.inf
            low, high = histogram.edges[index - 1], histogram.edges[index]
            return low + (rank - below) / count * (high - low)
        below += count
    return math.inf


@dataclass(frozen=True, kw_only=True, slots=True)
class CombinedStats:
    """The sites' released reports added up (suppressed cells as 0, and counted)."""

    sites: dict[str, SiteStats]
    records: int
    categories: dict[str, dict[str, int]]
    histograms: dict[str, Histogram]
    missing: dict[str, int]
    suppressed: int
    epsilon: float
    """The largest epsilon any site spent: the combined table's (the sites hold disjoint records)."""


def combine(sites: Mapping[str, SiteStats]) -> CombinedStats:
    """Every site's report summed cell by cell; histograms must share their edges."""
    categories: dict[str, dict[str, int]] = {}
    histograms: dict[str, list[int]] = {}
    edges: dict[str, tuple[float, ...]] = {}
    missing: dict[str, int] = {}
    for site, stats in sites.items():
        for name, values in stats.categories.items():
            into = categories.setdefault(name, {})
            for key, value in values.items():
                into[key] = into.get(key, 0) + (value or 0)
        for name, histogram in stats.histograms.items():
            if edges.setdefault(name, histogram.edges) != histogram.edges:
                raise StatsError(
                    f"site {site}: histogram {name!r} has other bin edges than the run's"
                )
            counts = histograms.setdefault(name, [0] * len(histogram.counts))
            for index, value in enumerate(histogram.counts):
                counts[index] += value or 0
        for name, value in stats.missing.items():
            missing[name] = missing.get(name, 0) + (value or 0)
    return CombinedStats(
        sites=dict(sites),
        records=sum(stats.records or 0 for stats in sites.values()),
        categories=categories,
        histograms={
            name: Histogram(edges=edges[name], counts=tuple(counts))
            for name, counts in histograms.items()
        },
        missing=missing,
        suppressed=sum(stats.release.suppressed for stats in sites.values()),
        epsilon=max((stats.release.epsilon for stats in sites.values()), default=0.0),
    )


def _items(value: Any) -> list[tuple[Any, Any]]:
    if not isinstance(value, dict) or len(value) > 10_000:
        raise ValueError("expected a mapping of at most 10000 entries")
    return list(value.items())


def _name(value: Any) -> str:
    if not isinstance(value, str) or len(value) > 200:
        raise ValueError(f"expected a name of at most 200 characters, got {str(value)[:50]!r}")
    return value


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 53:
        raise ValueError(f"expected a count, got {str(value)[:50]!r}")
    return value


def _cell(value: Any) -> Cell:
    return None if value is None else _count(value)


def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {str(value)[:50]!r}")
    return float(value)


def _histogram(value: Any) -> Histogram:
    edges = tuple(_number(edge) for edge in value["edges"])
    counts = tuple(_cell(count) for count in value["counts"])
    if not 2 <= len(edges) <= 1001 or len(counts) != len(edges) + 1:
        raise ValueError("a histogram has 2 to 1001 edges and one count more than edges")
    if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise ValueError("histogram edges must increase")
    return Histogram(edges=edges, counts=counts)


def _release(value: Any) -> dict[str, Any]:
    mechanism = value["mechanism"]
    if mechanism not in ("", *MECHANISMS):
        raise ValueError(f"unknown noise mechanism {str(mechanism)[:50]!r}")
    return {
        "min_cell_count": _count(value["min_cell_count"]),
        "mechanism": mechanism,
        "epsilon": _number(value["epsilon"]),
        "delta": _number(value["delta"]),
        "suppressed": _count(value["suppressed"]),
    }
