"""What a site counts for the cohort statistics (`hydrafl.cohort_stats`): from its own file's raw rows when it
reads one, else from its share of the run's cohort (train and test rows; simulated cohorts are standardised,
so their features are in standard deviations). The site policy then releases the counts (`SitePolicy.release`)."""

from __future__ import annotations

import numpy as np

from hydrafl.cohort_stats import Histogram, SiteStats, StatsError, count_histogram, shared_edges
from hydrafl.config_sections import StatsConfig
from hydrafl.data import TaskSpec
from hydrafl.data.tokenizer import PAD_ID


def site_stats(task: TaskSpec, x: np.ndarray, y: np.ndarray, cfg: StatsConfig) -> SiteStats:
    """The counts of one site's rows `x` with labels `y` (a target per token: no label counts), raw."""
    categories: dict[str, dict[str, int | None]] = {}
    if y.ndim == 1 and task.class_names:
        counts = np.bincount(y, minlength=task.num_classes)
        categories["label"] = {
            name: int(n) for name, n in zip(task.class_names, counts, strict=True)
        }
    histograms: dict[str, Histogram] = {}
    missing: dict[str, int | None] = {}
    vocabulary, sensitivity = None, 0
    if task.modality == "tabular":
        for column, (low, high) in enumerate(_ranges(cfg, x.shape[1], "feature")):
            name = f"feature {column}"
            histograms[name] = _histogram(x[:, column], low, high, cfg.stats_bins)
            missing[name] = int((~np.isfinite(x[:, column])).sum())
    elif task.modality == "text":
        tokens = x != PAD_ID
        seq_len = x.shape[1]
        histograms["text length"] = _histogram(
            tokens.sum(axis=1), 0, seq_len + 1, min(cfg.stats_bins, seq_len + 1)
        )
        vocabulary, sensitivity = int(np.unique(x[tokens]).size), seq_len
    elif task.modality == "image":
        size = "x".join(str(n) for n in x.shape[1:])
        categories["image size"] = {size: len(x)}
        for channel, (low, high) in enumerate(_ranges(cfg, x.shape[1], "channel")):
            means = x[:, channel].reshape(len(x), -1).mean(axis=1)
            histograms[f"channel {channel} mean"] = _histogram(means, low, high, cfg.stats_bins)
    return SiteStats(
        modality=task.modality,
        records=len(x),
        categories=categories,
        histograms=histograms,
        missing=missing,
        vocabulary=vocabulary,
        vocabulary_sensitivity=sensitivity,
    )


def _histogram(values: np.ndarray, low: float, high: float, bins: int) -> Histogram:
    edges = shared_edges(low, high, bins)
    return Histogram(edges=edges, counts=count_histogram(values.astype(np.float64), edges))


def _ranges(cfg: StatsConfig, count: int, what: str) -> tuple[tuple[float, float], ...]:
    """One (LO, HI) per feature or channel: the run's single range repeated, or its list of `count`."""
    ranges = cfg.stats_ranges
    if len(ranges) == 1:
        return ranges * count
    if len(ranges) != count:
        raise StatsError(
            f"stats-range gives {len(ranges)} ranges, and this site's data has {count} {what}s; give one "
            f"LO:HI, or one per {what}"
        )
    return ranges
