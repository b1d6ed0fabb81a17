"""A site's keyed MinHash signatures: estimates as accurate as the number of permutations allows, unrelated to
the unkeyed signature and to the signature under another key, and the drop list the site keeps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasketch import MinHash
from flwr.app import Context, RecordDict

from hydrafl.client.dedup import (
    DedupRefused,
    consortium_key,
    deduplicated,
    key_check,
    record_tokens,
    signatures,
    store_drop,
)
from hydrafl.data import SiteSplit

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def _pairs_with_jaccard(jaccard: float, count: int, size: int = 300) -> list[tuple[list, list]]:
    """`count` pairs of token sets of `size` tokens each whose Jaccard similarity is exactly `jaccard`."""
    shared = round(2 * size * jaccard / (1 + jaccard))
    pairs = []
    for p in range(count):
        common = [f"p{p}-c{i}".encode() for i in range(shared)]
        a = common + [f"p{p}-a{i}".encode() for i in range(size - shared)]
        b = common + [f"p{p}-b{i}".encode() for i in range(size - shared)]
        pairs.append((a, b))
    return pairs


@pytest.mark.parametrize("num_perm", [64, 256])
@pytest.mark.parametrize("jaccard", [0.3, 0.8])
def test_jaccard_estimates_have_the_error_the_number_of_permutations_gives(num_perm, jaccard):
    pairs = _pairs_with_jaccard(jaccard, count=60)
    exact = len(set(pairs[0][0]) & set(pairs[0][1])) / len(set(pairs[0][0]) | set(pairs[0][1]))
    records = [tokens for pair in pairs for tokens in pair]
    values = signatures(records, KEY, num_perm)
    estimates = (values[0::2] == values[1::2]).mean(axis=1)
    expected_error = np.sqrt(
        exact * (1 - exact) / num_perm
    )  # binomial: each permutation agrees w.p. J
    assert abs(estimates.mean() - exact) < 4 * expected_error / np.sqrt(len(pairs))  # unbiased
    assert 0.6 * expected_error < estimates.std() < 1.5 * expected_error
    assert np.abs(estimates - exact).max() < 4.5 * expected_error


def test_a_signature_under_another_key_or_unkeyed_shares_nothing_with_the_keyed_one():
    records = [[f"word{i}-{j}".encode() for j in range(30)] for i in range(50)]
    keyed = signatures(records, KEY, 128)
    assert (signatures(records, KEY, 128) == keyed).all()  # the same key: the same signature
    other = signatures(records, OTHER_KEY, 128)
    unkeyed = np.stack([_unkeyed(tokens) for tokens in records])
    # two independent minima over 30 tokens of 2^32 values agree about never; a few in 6400 by chance at most
    assert (keyed == other).mean() < 0.002
    assert (keyed == unkeyed).mean() < 0.002


def _unkeyed(tokens: list[bytes]) -> np.ndarray:
    """datasketch's signature with its own keyless hash (SHA-1), the same permutations."""
    sketch = MinHash(128, seed=1, scheme="affine32")
    sketch.update_batch(tokens)
    return sketch.hashvalues


def test_the_key_check_tells_keys_apart_without_carrying_the_key():
    assert key_check(KEY) == key_check(bytes(KEY))
    assert key_check(KEY) != key_check(OTHER_KEY)
    assert KEY.hex() not in key_check(KEY)


def test_a_site_without_a_key_or_with_images_is_refused_with_the_fix():
    with pytest.raises(DedupRefused, match="--dedup-key-file"):
        consortium_key("")
    with pytest.raises(DedupRefused, match="image records"):
        record_tokens(torch.zeros(3, 8, 8), "image")


def test_a_note_is_its_words_and_a_row_its_column_value_pairs():
    note = torch.tensor([1, 40, 41, 40, 0, 0])
    assert sorted(record_tokens(note, "text")) == [b"1", b"40", b"40", b"41"]
    row = torch.tensor([0.5, -1.25])
    assert record_tokens(row, "tabular") == [b"0=0.5", b"1=-1.25"]


def _split(rows: int) -> SiteSplit:
    x = torch.arange(rows * 2, dtype=torch.float32).reshape(rows, 2)
    return SiteSplit(train_x=x, train_y=torch.arange(rows), test_x=x[:1], test_y=torch.arange(1))


def test_the_drop_list_is_kept_for_the_run_and_leaves_the_test_split_alone():
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    split = _split(5)
    assert deduplicated(split, context) is split  # before the exchange: every record
    store_drop(context, np.array([1, 3]), records=5)
    kept = deduplicated(split, context)
    assert kept.train_y.tolist() == [0, 2, 4]
    assert kept.test_y.tolist() == split.test_y.tolist()


@pytest.mark.parametrize(
    ("drop", "reason"),
    [
        (np.array([5]), "outside"),
        (np.array([-1]), "outside"),
        (np.array([2, 2]), "twice"),
        (np.array([[1]]), "1-D integer"),
        (np.array([0.5]), "1-D integer"),
    ],
)
def test_a_drop_list_naming_rows_the_site_has_not_is_refused(drop, reason):
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(DedupRefused, match=reason):
        store_drop(context, drop, records=5)
    assert "dedup" not in context.state
