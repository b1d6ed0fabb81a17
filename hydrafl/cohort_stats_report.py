"""The cohort statistics as people read them: stats.json (every site's released report and the sum), stats.md
(tables) and two PNGs (labels per site; each histogram per site and combined)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from hydrafl.cohort_stats import (
    QUANTILES,
    Cell,
    CombinedStats,
    Histogram,
    SiteStats,
    histogram_quantile,
)

MAX_PLOTTED = 12
"""Histograms drawn in stats_histograms.png (the tables list them all)."""


def write_stats(out: Path, combined: CombinedStats, declined: dict[str, str]) -> list[Path]:
    """stats.json, stats.md, stats_labels.png and stats_histograms.png in `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "sites": {site: dataclasses.asdict(stats) for site, stats in combined.sites.items()},
        "combined": {
            "records": combined.records,
            "categories": combined.categories,
            "histograms": {n: dataclasses.asdict(h) for n, h in combined.histograms.items()},
            "missing": combined.missing,
            "suppressed": combined.suppressed,
            "epsilon": combined.epsilon,
            "quantiles": {
                name: [histogram_quantile(h, q) for q in QUANTILES]
                for name, h in combined.histograms.items()
            },
        },
        "declined": declined,
    }
    paths = [out / name for name in ("stats.json", "stats.md")]
    if "label" in combined.categories:
        paths.append(_plot_labels(out / "stats_labels.png", combined))
    if combined.histograms:
        paths.append(_plot_histograms(out / "stats_histograms.png", combined))
    figures = [f"![{path.stem}]({path.name})" for path in paths[2:]]
    paths[0].write_text(json.dumps(summary, indent=1))
    paths[1].write_text("\n".join([*_markdown(combined, declined), "", *figures]) + "\n")
    return paths


def _markdown(combined: CombinedStats, declined: dict[str, str]) -> list[str]:
    sites = list(combined.sites)
    header = ["", *(f"site {site}" for site in sites), "all"]
    lines = [
        "# Cohort statistics",
        "",
        f"{len(sites)} sites reported; a suppressed cell (under the site's min-cell-count) shows as `<k` and "
        "counts as 0 in the sums. Quantiles come from the histograms on the run's shared bins: each lies within "
        "one bin width of the pooled data's own; `<LO` / `>HI` fall in the open bins outside the range.",
        "",
        *_table(
            header,
            [
                [
                    "records",
                    *(_cell(s.records, s) for s in combined.sites.values()),
                    str(combined.records),
                ]
            ],
        ),
    ]
    for category, totals in combined.categories.items():
        rows = [
            [
                value,
                *(
                    _cell(s.categories.get(category, {}).get(value), s)
                    for s in combined.sites.values()
                ),
                str(total),
            ]
            for value, total in totals.items()
        ]
        lines += ["", f"## {category}", "", *_table(header, rows)]
    if combined.histograms:
        lines += ["", "## Distributions", ""]
        columns = [
            "",
            "site",
            "missing",
            *(f"q{round(q * 100):02d}" for q in QUANTILES),
            "bin width",
        ]
        rows = []
        for name, histogram in combined.histograms.items():
            per_site = [
                (f"site {site}", stats.histograms[name], stats.missing.get(name), stats.records)
                for site, stats in combined.sites.items()
                if name in stats.histograms
            ]
            everyone = ("all", histogram, combined.missing.get(name), combined.records)
            for label, each, missing, records in [*per_site, everyone]:
                rows.append(
                    [
                        name,
                        label,
                        _share(missing, records),
                        *(_quantile(each, q) for q in QUANTILES),
                        f"{histogram.width:.4g}",
                    ]
                )
        lines += _table(columns, rows)
    vocabularies = {
        site: s.vocabulary for site, s in combined.sites.items() if s.vocabulary is not None
    }
    if vocabularies:
        known = [v for v in vocabularies.values() if v is not None]
        lines += [
            "",
            "## Vocabulary",
            "",
            *(
                f"- site {site}: {_cell(v, combined.sites[site])} distinct tokens"
                for site, v in vocabularies.items()
            ),
            f"- all: between {max(known, default=0)} and {sum(known)} (the sites' vocabularies overlap by an "
            "amount no count reveals)",
        ]
    lines += [
        "",
        "## Privacy",
        "",
        *_table(
            ["site", "min-cell-count", "noise", "epsilon", "delta", "suppressed cells"],
            [
                [
                    site,
                    str(s.release.min_cell_count or "-"),
                    s.release.mechanism or "none",
                    f"{s.release.epsilon:g}" if s.release.mechanism else "-",
                    f"{s.release.delta:g}" if s.release.delta else "-",
                    str(s.release.suppressed),
                ]
                for site, s in combined.sites.items()
            ],
        ),
    ]
    if combined.epsilon:
        lines += [
            "",
            f"The combined table is ({combined.epsilon:g}, delta)-DP for any one record: each site's release is "
            "DP for its own records, and the sites' records are disjoint.",
        ]
    if declined:
        lines += [
            "",
            "## Sites that declined",
            "",
            *(f"- site {s}: {why}" for s, why in declined.items()),
        ]
    return lines


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _cell(value: Cell, stats: SiteStats) -> str:
    """A count as released; a suppressed one as `<k`, k the site's min-cell-count."""
    return f"<{stats.release.min_cell_count}" if value is None else str(value)


def _share(missing: Cell, records: Cell) -> str:
    if missing is None or not records:
        return "-"
    return f"{missing / records:.1%}"


def _quantile(histogram: Histogram, q: float) -> str:
    value = histogram_quantile(histogram, q)
    if value is None:
        return "-"
    if math.isinf(value):
        return f"<{histogram.edges[0]:g}" if value < 0 else f">{histogram.edges[-1]:g}"
    return f"{value:.4g}"


def _plot_labels(path: Path, combined: CombinedStats) -> Path:
    labels = list(combined.categories["label"])
    sites = list(combined.sites)
    figure, axis = plt.subplots(figsize=(max(5, 1 + 0.8 * len(sites)), 4))
    bottoms = [0] * len(sites)
    for label in labels:
        heights = [combined.sites[s].categories.get("label", {}).get(label) or 0 for s in sites]
        axis.bar([f"site {s}" for s in sites], heights, bottom=bottoms, label=label)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    axis.set(ylabel="records", title="Labels per site")
    axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plot_histograms(path: Path, combined: CombinedStats) -> Path:
    names = list(combined.histograms)[:MAX_PLOTTED]
    columns = min(3, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3 * rows), squeeze=False)
    for axis, name in zip(axes.flat, names, strict=False):
        edges = combined.histograms[name].edges
        centres = [(a + b) / 2 for a, b in zip(edges, edges[1:], strict=False)]
        for site, stats in combined.sites.items():
            if name in stats.histograms:
                inner = [c or 0 for c in stats.histograms[name].counts[1:-1]]
                axis.step(centres, inner, where="mid", label=f"site {site}")
        axis.step(
            centres,
            list(combined.histograms[name].counts[1:-1]),
            where="mid",
            color="black",
            label="all",
        )
        axis.set(title=name, ylabel="records")
    for axis in list(axes.flat)[len(names) :]:
        axis.axis("off")
    axes.flat[0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
