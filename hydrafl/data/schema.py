"""The data contract shared by every cohort source: what a task is, what one site holds, and the error type.

Everything downstream (models, trainer, strategies) depends only on these three records, so a synthetic
cohort and a hospital's own CSV are interchangeable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class DataError(ValueError):
    """Bad input data or arguments; the message names the file, line and/or column and says how to fix it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TaskSpec:
    """What a model needs to know about a task to be built for it; fields of other modalities stay 0."""

    name: str
    modality: str
    objective: str = "classification"
    """classification (one label per row) or next-token (a target id per position; `num_classes` = vocabulary)."""
    num_classes: int
    class_names: tuple[str, ...]
    vocab_size: int = 0
    seq_len: int = 0
    image_size: int = 0
    channels: int = 0
    num_features: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteSplit:
    """One hospital's local data; it never leaves the site, so train and test live together here."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    train_records: torch.Tensor | None = None
    """Tabular: the training rows as recorded, before standardisation (which differs between sites that each
    standardise their own file), row for row with `train_x`: what deduplication compares. None: `train_x`."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Cohort:
    """A simulated consortium: one task and one split per site (site i is `sites[i]`)."""

    task: TaskSpec
    sites: tuple[SiteSplit, ...]
    planted: tuple[tuple[int, int, int, int], ...] = ()
    """Planted cross-site duplicates (`hydrafl.data.duplicates`): (site, train row, copy's site, copy's train
    row) of every copy, which deduplication should find."""
