"""How pooled rows are dealt out to sites (flwr-datasets partitioners) and how each site splits train/test.

Synthetic cohorts are "natural" by default (each site generated as its own hospital); the label-based
schemes here re-deal pooled rows to study a controlled amount of label skew, as in the FL literature.
"""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass

import numpy as np

from hydrafl.data.schema import DataError
from hydrafl.data.sites import POOL_STREAM, SPLIT_STREAM, site_rng

# The partitioners only ever see an in-memory Dataset; make sure nothing tries to reach the Hub.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PARTITION_FORMS = (
    "natural",
    "iid",
    "dirichlet:ALPHA (ALPHA > 0)",
    "pathological:K (integer K >= 1)",
)


@dataclass(frozen=True, slots=True)
class Partition:
    """A parsed `partition` string."""

    kind: str  # "natural" | "iid" | "dirichlet" | "pathological"
    alpha: float = 0.0
    classes_per_site: int = 0


def parse_partition(partition: str) -> Partition:
    """Parse "natural", "iid", "dirichlet:ALPHA" or "pathological:K"; anything else is a DataError."""
    kind, _, arg = partition.strip().lower().partition(":")
    if kind in ("natural", "iid") and not arg:
        return Partition(kind)
    if kind == "dirichlet" and arg:
        try:
            alpha = float(arg)
        except ValueError:
            alpha = math.nan
        if math.isfinite(alpha) and alpha > 0:
            return Partition(kind, alpha=alpha)
        raise DataError(
            f"partition {partition!r}: ALPHA must be a finite number > 0, e.g. 'dirichlet:0.5'"
        )
    if kind == "pathological" and arg:
        if arg.isdigit() and int(arg) >= 1:
            return Partition(kind, classes_per_site=int(arg))
        raise DataError(
            f"partition {partition!r}: K must be an integer >= 1, e.g. 'pathological:2'"
        )
    raise DataError(
        f"unknown partition {partition!r}; valid forms are: {', '.join(PARTITION_FORMS)}"
    )


def split_by_label(
    labels: np.ndarray, scheme: Partition, num_sites: int, seed: int
) -> list[np.ndarray]:
    """Row indices (into `labels`) for each site, dealt by an iid/dirichlet/pathological flwr-datasets partitioner."""
    # Imported here: `datasets` costs ~1.5 s to import and natural-mode cohorts never need it.
    from datasets import Dataset
    from flwr_datasets.partitioner import (
        DirichletPartitioner,
        IidPartitioner,
        PathologicalPartitioner,
    )

    n = labels.size
    num_classes = np.unique(labels).size
    if n < 2 * num_sites:
        raise DataError(
            f"{n} rows are too few for {num_sites} sites (each needs one train and one test row)"
        )
    if scheme.kind == "pathological" and scheme.classes_per_site > num_classes:
        raise DataError(
            f"partition 'pathological:{scheme.classes_per_site}' asks for more classes per site than the "
            f"{num_classes} the data has; use K <= {num_classes}"
        )
    if scheme.kind == "iid":
        partitioner = IidPartitioner(num_sites)
    elif scheme.kind == "dirichlet":
        partitioner = DirichletPartitioner(
            num_sites,
            partition_by="label",
            alpha=scheme.alpha,
            seed=seed,
            min_partition_size=max(2, min(10, n // (2 * num_sites))),
        )
    else:
        # "first-deterministic" gives site i class i first, so every class is used whenever num_sites >= num_classes.
        partitioner = PathologicalPartitioner(
            num_sites,
            partition_by="label",
            num_classes_per_partition=scheme.classes_per_site,
            class_assignment_mode="first-deterministic",
            seed=seed,
        )
    # Shuffle first: IidPartitioner shards contiguously, and pooled synthetic rows arrive site by site.
    order = site_rng(seed, 0, POOL_STREAM).permutation(n)
    partitioner.dataset = Dataset.from_dict(
        {"row": order.tolist(), "label": labels[order].tolist()}
    )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore"
            )  # retry notices from DirichletPartitioner; failure is raised below
            sites = [
                np.asarray(partitioner.load_partition(site)["row"], dtype=np.int64)
                for site in range(num_sites)
            ]
    except ValueError as err:
        raise DataError(
            f"partition '{scheme.kind}' could not split {n} rows over {num_sites} sites ({err}); "
            "use fewer sites, more rows, or a milder partition (larger ALPHA / K)"
        ) from err
    unused = sorted(
        set(np.unique(labels).tolist()) - set(np.unique(labels[np.concatenate(sites)]).tolist())
    )
    if unused:
        warnings.warn(
            f"partition 'pathological:{scheme.classes_per_site}' over {num_sites} sites leaves class(es) {unused} "
            "on no site; their rows are dropped (use more sites or a larger K to keep them)",
            stacklevel=3,
        )
    return sites


def train_test_indices(
    n: int, test_fraction: float, *, seed: int, site: int, num_sites: int
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split of one site's n rows into (train, test) positions; both sides get at least one row."""
    if n < 2:
        raise DataError(
            f"site {site} has {n} row(s) but needs at least 2 (one train, one test): too few rows for "
            f"{num_sites} sites; use fewer sites, more rows, or a less skewed partition"
        )
    order = site_rng(seed, site, SPLIT_STREAM).permutation(n)
    num_test = min(max(round(n * test_fraction), 1), n - 1)
    return order[num_test:], order[:num_test]
