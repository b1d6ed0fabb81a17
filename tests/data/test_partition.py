"""Label-based re-partitioning of pooled rows (flwr-datasets) and the per-site train/test split."""

import itertools

import numpy as np
import pytest
import torch

from hydrafl.data import Cohort, DataError, load_cohort
from hydrafl.data.partition import Partition, parse_partition


def _site_labels(cohort: Cohort) -> list[np.ndarray]:
    return [torch.cat([s.train_y, s.test_y]).numpy() for s in cohort.sites]


def _mean_tv(cohort: Cohort) -> float:
    k = cohort.task.num_classes
    dists = [np.bincount(y, minlength=k) / y.size for y in _site_labels(cohort)]
    return float(np.mean([0.5 * np.abs(a - b).sum() for a, b in itertools.combinations(dists, 2)]))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("natural", Partition("natural")),
        (" IID ", Partition("iid")),
        ("dirichlet:0.5", Partition("dirichlet", alpha=0.5)),
        ("pathological:2", Partition("pathological", classes_per_site=2)),
    ],
)
def test_parse_partition(text: str, expected: Partition) -> None:
    assert parse_partition(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("random", "valid forms are: natural, iid, dirichlet:ALPHA"),
        ("iid:3", "valid forms"),
        ("dirichlet", "valid forms"),
        ("dirichlet:0", "ALPHA must be a finite number > 0"),
        ("dirichlet:-1", "ALPHA must be"),
        ("dirichlet:abc", "ALPHA must be"),
        ("dirichlet:inf", "ALPHA must be"),
        ("pathological:0", "K must be an integer >= 1"),
        ("pathological:1.5", "K must be an integer"),
    ],
)
def test_bad_partitions_are_rejected_with_the_valid_forms(text: str, message: str) -> None:
    with pytest.raises(DataError, match=message):
        parse_partition(text)
    with pytest.raises(DataError, match=message):
        load_cohort("tabular", partition=text, samples_per_site=20)


def test_iid_gives_equal_sizes_and_matching_label_mixes() -> None:
    natural, iid = load_cohort("tabular"), load_cohort("tabular", partition="iid")
    sizes = [len(y) for y in _site_labels(iid)]
    assert sizes == [400] * 4
    assert all(len(s.test_y) == 80 for s in iid.sites)
    assert _mean_tv(iid) < 0.06 < 0.15 < _mean_tv(natural)
    # Same pooled rows, dealt differently.
    pooled = sorted(torch.cat([torch.cat([s.train_y, s.test_y]) for s in natural.sites]).tolist())
    assert sorted(np.concatenate(_site_labels(iid)).tolist()) == pooled


def test_dirichlet_skew_grows_as_alpha_shrinks() -> None:
    skewed = load_cohort("clinical-text", partition="dirichlet:0.1")
    mild = load_cohort("clinical-text", partition="dirichlet:100")
    assert _mean_tv(skewed) > 0.4
    assert _mean_tv(mild) < 0.08
    assert all(len(s.train_y) >= 1 and len(s.test_y) >= 1 for s in skewed.sites)
    assert sum(len(y) for y in _site_labels(skewed)) == 1600


def test_dirichlet_is_deterministic_per_seed() -> None:
    a = load_cohort("tabular", partition="dirichlet:0.5", seed=7)
    b = load_cohort("tabular", partition="dirichlet:0.5", seed=7)
    c = load_cohort("tabular", partition="dirichlet:0.5", seed=8)
    assert all(torch.equal(x.train_x, y.train_x) for x, y in zip(a.sites, b.sites, strict=True))
    assert [len(s.train_y) for s in a.sites] != [len(s.train_y) for s in c.sites]


def test_pathological_one_gives_one_class_per_site_and_uses_every_class() -> None:
    cohort = load_cohort("chest-xray", partition="pathological:1")
    classes = [set(y.tolist()) for y in _site_labels(cohort)]
    assert all(len(c) == 1 for c in classes)
    assert set().union(*classes) == set(
        range(4)
    )  # 4 sites, 4 classes: each class lives at exactly one site


def test_pathological_two_gives_two_classes_per_site() -> None:
    cohort = load_cohort("clinical-text", partition="pathological:2", num_sites=5)
    assert all(len(set(y.tolist())) == 2 for y in _site_labels(cohort))


def test_pathological_with_more_classes_than_exist_is_rejected() -> None:
    with pytest.raises(DataError, match="more classes per site than the 3"):
        load_cohort("tabular", partition="pathological:4")


def test_pathological_warns_when_classes_are_left_out() -> None:
    with pytest.warns(UserWarning, match="leaves class"):
        cohort = load_cohort("clinical-text", partition="pathological:1", num_sites=2)
    assert [set(y.tolist()) for y in _site_labels(cohort)] == [{0}, {1}]
