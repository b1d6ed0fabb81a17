"""Cohorts of hospital sites for federated fine-tuning: synthetic non-IID hospitals or the user's own files.

Nothing is downloaded at run time. `load_cohort` returns, for every site, train and test tensors whose
format is fixed by the cohort's `TaskSpec`, so models and training code never look at where the data came from.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from hydrafl.catalog import NEXT_TOKEN_TASKS, TASKS
from hydrafl.data import image_cohort, notes_lm_cohort, tabular_cohort, text_cohort
from hydrafl.data.duplicates import plant_duplicates
from hydrafl.data.files import read_dataset
from hydrafl.data.partition import parse_partition, split_by_label, train_test_indices
from hydrafl.data.schema import Cohort, DataError, SiteSplit, TaskSpec
from hydrafl.data.tokenizer import tokenize

__all__ = [
    "NEXT_TOKEN_TASKS",
    "TASKS",
    "Cohort",
    "DataError",
    "SiteSplit",
    "TaskSpec",
    "load_cohort",
    "tokenize",
]

_GENERATORS = {
    "clinical-text": text_cohort,
    "chest-xray": image_cohort,
    "tabular": tabular_cohort,
    notes_lm_cohort.TASK: notes_lm_cohort,
}


def load_cohort(
    task: str = "clinical-text",
    *,
    num_sites: int = 4,
    seed: int = 0,
    partition: str | None = None,
    data_path: str | Path | None = None,
    label_column: str | None = None,
    samples_per_site: int = 400,
    test_fraction: float = 0.2,
    text_tokenizer: str = "hash",
    duplicates: float = 0.0,
) -> Cohort:
    """Build a cohort of `num_sites` sites, each with a seeded train/test split.

    Synthetic tasks (TASKS) generate `samples_per_site` rows per hospital; `partition` defaults to "natural"
    (keep each hospital's own rows) and may re-deal the pooled rows ("iid", "dirichlet:ALPHA",
    "pathological:K"). With `data_path` the file or image folder is used instead (`task` and
    `samples_per_site` are ignored), `partition` defaults to "iid" and `label_column` names the label
    of a table. `text_tokenizer` ("hash" or "minilm", see `text_cohort.TOKENIZERS`) encodes synthetic notes.
    `duplicates` > 0 plants copies of that fraction of the other sites' training records at site 0
    (`hydrafl.data.duplicates`, synthetic cohorts only).
    Same arguments give bit-identical tensors.
    """
    _check_arguments(
        num_sites=num_sites,
        seed=seed,
        samples_per_site=samples_per_site,
        test_fraction=test_fraction,
        duplicates=duplicates,
    )
    if data_path is not None:
        if text_tokenizer != "hash":
            raise DataError(
                f"the {text_tokenizer!r} tokenizer is for synthetic notes; files use the hashing tokenizer"
            )
        spec, x, y = read_dataset(Path(data_path), label_column)
        scheme = parse_partition("iid" if partition is None else partition)
        if scheme.kind == "natural":
            raise DataError(
                f"partition 'natural' keeps each synthetic hospital's own rows, which a single file does not have; "
                f"for {Path(data_path).name} use iid, dirichlet:ALPHA or pathological:K"
            )
        site_rows = split_by_label(y, scheme, num_sites, seed)
    else:
        if task not in _GENERATORS:
            raise DataError(
                f"unknown task {task!r}; choose one of {', '.join(TASKS + NEXT_TOKEN_TASKS)}, or pass --data for "
                "your own data"
            )
        generator = _GENERATORS[task]
        options = {"tokenizer": text_tokenizer} if generator is text_cohort else {}
        spec = generator.task_spec(**options)
        scheme = parse_partition("natural" if partition is None else partition)
        parts = [
            generator.generate_site(seed, site, samples_per_site, **options)
            for site in range(num_sites)
        ]
        x = np.concatenate([features for features, _ in parts])
        y = np.concatenate([labels for _, labels in parts])
        if scheme.kind == "natural":
            site_rows = [
                np.arange(site * samples_per_site, (site + 1) * samples_per_site)
                for site in range(num_sites)
            ]
        elif y.ndim > 1 and scheme.kind != "iid":
            raise DataError(
                f"partition {partition!r} deals rows by class label, which task {task!r} (a target per token) does "
                "not have; use natural (one hospital per site) or iid"
            )
        else:
            site_rows = split_by_label(
                y if y.ndim == 1 else np.zeros(len(y), dtype=np.int64), scheme, num_sites, seed
            )

    train_rows, test_rows = [], []
    for site, rows in enumerate(site_rows):
        train, test = train_test_indices(
            rows.size, test_fraction, seed=seed, site=site, num_sites=num_sites
        )
        train_rows.append(rows[train])
        test_rows.append(rows[test])
    planted: tuple[tuple[int, int, int, int], ...] = ()
    if duplicates:
        if data_path is not None:
            raise DataError(
                "duplicates are planted in synthetic cohorts; a --data file has its own"
            )
        x, y, train_rows, planted = plant_duplicates(
            x,
            y,
            train_rows,
            fraction=duplicates,
            modality=spec.modality,
            vocab_size=spec.vocab_size,
            seed=seed,
        )
    recorded = x if spec.modality == "tabular" else None
    x = _standardise(x, np.concatenate(train_rows), spec.modality)
    sites = tuple(
        SiteSplit(
            train_x=torch.from_numpy(x[train]),
            train_y=torch.from_numpy(y[train]),
            test_x=torch.from_numpy(x[test]),
            test_y=torch.from_numpy(y[test]),
            train_records=None if recorded is None else torch.from_numpy(recorded[train]),
        )
        for train, test in zip(train_rows, test_rows, strict=True)
    )
    return Cohort(task=spec, sites=sites, planted=planted)


def _check_arguments(
    *, num_sites: int, seed: int, samples_per_site: int, test_fraction: float, duplicates: float
) -> None:
    if num_sites < 1:
        raise DataError(f"num_sites must be at least 1; got {num_sites}")
    if seed < 0:
        raise DataError(f"seed must be a non-negative integer; got {seed}")
    if samples_per_site < 2:
        raise DataError(
            f"samples_per_site must be at least 2 (one train and one test row per site); got {samples_per_site}"
        )
    if not 0.0 < test_fraction < 1.0:
        raise DataError(f"test_fraction must be strictly between 0 and 1; got {test_fraction}")
    if not 0.0 <= duplicates <= 1.0:
        raise DataError(f"duplicates must be a fraction in [0, 1]; got {duplicates}")


def _standardise(x: np.ndarray, train_rows: np.ndarray, modality: str) -> np.ndarray:
    """Zero-mean unit-variance using only pooled TRAIN rows, so no test statistics leak into training.

    Tabular features are scaled per column; images by one scalar, which keeps each scanner's intensity shift.
    Token ids are returned unchanged.
    """
    if modality == "text":
        return x
    train = x[train_rows].astype(np.float64)
    axis = 0 if modality == "tabular" else None
    mean, std = train.mean(axis=axis), train.std(axis=axis)
    return ((x - mean) / np.where(std > 0, std, 1.0)).astype(np.float32)
