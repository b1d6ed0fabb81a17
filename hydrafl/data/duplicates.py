"""Planted cross-site duplicates: the same patients' records at two hospitals, so deduplication has something
to find and its effect shows.

Site 0 plays a referral centre: besides its own patients it holds copies of a `fraction` of the other sites'
training records, appended to its training split. Half the copies are exact; half are near copies, as a record
re-entered at another hospital is: one word of a note changed, or one measurement of a row re-taken. The copies
inflate the referral centre's sample weight, as shared patients do in a real consortium.
"""

from __future__ import annotations

import numpy as np

from hydrafl.data.schema import DataError
from hydrafl.data.sites import DUPLICATE_STREAM, site_rng
from hydrafl.data.tokenizer import NUM_SPECIAL, PAD_ID

REFERRAL_SITE = 0
"""The site that receives the copies."""
MODALITIES = ("text", "tabular")
"""What can be planted: records the deduplication can compare (tokens of a note, columns of a row)."""


def plant_duplicates(
    x: np.ndarray,
    y: np.ndarray,
    train_rows: list[np.ndarray],
    *,
    fraction: float,
    modality: str,
    vocab_size: int,
    seed: int,
) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], tuple[tuple[int, int, int, int], ...]]:
    """`x`, `y` with the copies appended, `train_rows` with the copies in the referral site's split, and the
    planted pairs (source site, source train position, REFERRAL_SITE, copy train position)."""
    if modality not in MODALITIES or y.ndim != 1:
        raise DataError(
            f"duplicates are planted in the classification cohorts of {' and '.join(MODALITIES)} records "
            f"(clinical-text, tabular), not in {modality} records; set duplicates to 0"
        )
    if len(train_rows) < 2:
        raise DataError("duplicates copy records across sites, which needs at least 2 sites")
    sources = [
        (site, position)
        for site in range(len(train_rows))
        if site != REFERRAL_SITE
        for position in range(train_rows[site].size)
    ]
    count = round(fraction * len(sources))
    rng = site_rng(seed, REFERRAL_SITE, DUPLICATE_STREAM)
    chosen = [sources[i] for i in np.sort(rng.choice(len(sources), size=count, replace=False))]
    source_rows = np.array(
        [train_rows[site][position] for site, position in chosen], dtype=np.int64
    )
    copies = x[source_rows].copy()
    near = rng.random(count) < 0.5
    for row in np.flatnonzero(near):
        if modality == "text":
            _change_one_word(copies[row], rng, vocab_size)
        else:
            column = rng.integers(copies.shape[1])
            copies[row, column] *= rng.uniform(1.01, 1.1)
    first = len(x)
    referral = train_rows[REFERRAL_SITE]
    rows = list(train_rows)
    rows[REFERRAL_SITE] = np.concatenate([referral, np.arange(first, first + count)])
    planted = tuple(
        (site, position, REFERRAL_SITE, referral.size + i)
        for i, (site, position) in enumerate(chosen)
    )
    return np.concatenate([x, copies]), np.concatenate([y, y[source_rows]]), rows, planted


def _change_one_word(ids: np.ndarray, rng: np.random.Generator, vocab_size: int) -> None:
    """One token id of a note (not its first, the CLS token, nor padding) replaced by another, in place."""
    words = np.flatnonzero(ids[1:] != PAD_ID) + 1
    position = words[rng.integers(words.size)]
    ids[position] = (ids[position] - NUM_SPECIAL + rng.integers(1, vocab_size - NUM_SPECIAL)) % (
        vocab_size - NUM_SPECIAL
    ) + NUM_SPECIAL
