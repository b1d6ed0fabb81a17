"""Synthetic cohorts: the contract of TaskSpec, determinism, and real (label and feature) site heterogeneity."""

import itertools

import numpy as np
import pytest
import torch

from hydrafl.data import TASKS, Cohort, DataError, load_cohort


def _labels(cohort: Cohort, site: int) -> np.ndarray:
    split = cohort.sites[site]
    return torch.cat([split.train_y, split.test_y]).numpy()


def _prevalence(cohort: Cohort, site: int) -> np.ndarray:
    counts = np.bincount(_labels(cohort, site), minlength=cohort.task.num_classes)
    return counts / counts.sum()


def _max_tv(cohort: Cohort) -> float:
    """Largest total-variation distance between two sites' label distributions."""
    pairs = itertools.combinations(range(len(cohort.sites)), 2)
    return max(
        0.5 * np.abs(_prevalence(cohort, a) - _prevalence(cohort, b)).sum() for a, b in pairs
    )


@pytest.fixture(scope="module", params=TASKS)
def cohort(request: pytest.FixtureRequest) -> Cohort:
    return load_cohort(request.param)


def test_shapes_dtypes_and_ranges_follow_the_task_spec(cohort: Cohort) -> None:
    task = cohort.task
    assert len(cohort.sites) == 4
    assert task.num_classes == len(task.class_names) >= 3
    for split in cohort.sites:
        assert split.train_y.shape == (320,) and split.test_y.shape == (80,)
        for x, y in ((split.train_x, split.train_y), (split.test_x, split.test_y)):
            assert y.dtype == torch.int64 and 0 <= int(y.min()) and int(y.max()) < task.num_classes
            assert x.shape[0] == y.shape[0]
            if task.modality == "text":
                assert x.dtype == torch.int64 and x.shape[1:] == (task.seq_len,)
                assert (x[:, 0] == 1).all() and int(x.min()) >= 0 and int(x.max()) < task.vocab_size
                # PAD only trails: once a row hits 0 it stays 0.
                is_pad = (x == 0).int()
                assert torch.equal(is_pad, torch.cummax(is_pad, dim=1).values)
            elif task.modality == "image":
                assert x.dtype == torch.float32
                assert (
                    x.shape[1:] == (task.channels, task.image_size, task.image_size) == (1, 32, 32)
                )
            else:
                assert x.dtype == torch.float32 and x.shape[1:] == (task.num_features,) == (12,)
            assert torch.isfinite(x.float()).all()


def test_features_are_standardised_with_pooled_train_statistics(cohort: Cohort) -> None:
    if cohort.task.modality == "text":
        pytest.skip("token ids are not standardised")
    train = torch.cat([split.train_x for split in cohort.sites]).double()
    if cohort.task.modality == "tabular":
        assert (
            train.mean(0).abs().max() < 1e-5
            and (train.std(0, unbiased=False) - 1).abs().max() < 1e-4
        )
    else:
        assert abs(train.mean()) < 1e-5 and abs(train.std(unbiased=False) - 1) < 1e-4
    test = torch.cat([split.test_x for split in cohort.sites]).double()
    assert (
        test.mean().abs() < 0.2
    )  # close to, but not exactly, standardised: no test statistics were used


@pytest.mark.parametrize("task", TASKS)
def test_same_arguments_are_bit_identical_and_seeds_differ(task: str) -> None:
    a, b, other = load_cohort(task, seed=3), load_cohort(task, seed=3), load_cohort(task, seed=4)
    assert a.task == b.task == other.task
    for sa, sb in zip(a.sites, b.sites, strict=True):
        for field in ("train_x", "train_y", "test_x", "test_y"):
            assert torch.equal(getattr(sa, field), getattr(sb, field))
    assert not torch.equal(a.sites[0].train_x, other.sites[0].train_x)
    assert not torch.equal(a.sites[0].train_y, other.sites[0].train_y)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("task", TASKS)
def test_every_site_sees_every_class_but_in_its_own_proportions(task: str, seed: int) -> None:
    cohort = load_cohort(task, seed=seed)
    for site, split in enumerate(cohort.sites):
        assert np.bincount(_labels(cohort, site), minlength=cohort.task.num_classes).min() >= 3
        assert set(split.train_y.tolist()) == set(range(cohort.task.num_classes))
    assert _max_tv(cohort) > 0.1


def test_tabular_sites_differ_in_population_and_measurement() -> None:
    cohort = load_cohort("tabular")
    age = [torch.cat([s.train_x[:, 0], s.test_x[:, 0]]).numpy() for s in cohort.sites]
    assert (
        max(a.mean() for a in age) - min(a.mean() for a in age) > 0.4
    )  # in pooled standard deviations
    # Measurement shift: within one disposition, lab means still differ between hospitals.
    wbc, lactate = 6, 7
    for column in (wbc, lactate):
        means = [s.train_x[s.train_y == 0, column].mean().item() for s in cohort.sites]
        assert max(means) - min(means) > 0.25


def test_chest_xray_scanners_shift_intensity_within_a_class() -> None:
    cohort = load_cohort("chest-xray")
    per_site = [
        s.train_x[s.train_y == 0].mean(dim=(1, 2, 3)).numpy() for s in cohort.sites
    ]  # normal images
    z_scores = [
        abs(a.mean() - b.mean()) / np.sqrt(a.var() / a.size + b.var() / b.size)
        for a, b in itertools.combinations(per_site, 2)
    ]
    assert max(z_scores) > 8


def test_clinical_text_sites_write_in_their_own_words() -> None:
    cohort = load_cohort("clinical-text")

    def words(x: torch.Tensor) -> set[int]:
        return set(x.unique().tolist()) - {0, 1}

    site0 = cohort.sites[0].train_x
    within = len(words(site0[:160]) & words(site0[160:])) / len(
        words(site0[:160]) | words(site0[160:])
    )
    across = [
        len(words(site0[:160]) & words(s.train_x[:160]))
        / len(words(site0[:160]) | words(s.train_x[:160]))
        for s in cohort.sites[1:]
    ]
    assert max(across) < within - 0.1


def test_generation_does_not_touch_the_global_rng() -> None:
    torch.manual_seed(123)
    np.random.seed(123)
    expected = torch.rand(1).item(), np.random.rand()
    torch.manual_seed(123)
    np.random.seed(123)
    for task in TASKS:
        load_cohort(task, samples_per_site=20)
    assert (torch.rand(1).item(), np.random.rand()) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task": "mri"}, "unknown task 'mri'"),
        ({"num_sites": 0}, "num_sites"),
        ({"seed": -1}, "seed"),
        ({"samples_per_site": 1}, "samples_per_site"),
        ({"test_fraction": 1.0}, "test_fraction"),
    ],
)
def test_bad_arguments_raise_data_error(kwargs: dict, message: str) -> None:
    with pytest.raises(DataError, match=message):
        load_cohort(**kwargs)


def test_small_sites_still_get_a_train_and_a_test_row() -> None:
    cohort = load_cohort("tabular", samples_per_site=2, num_sites=3)
    assert all(len(s.train_y) == 1 and len(s.test_y) == 1 for s in cohort.sites)
