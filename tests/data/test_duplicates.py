"""Planted cross-site duplicates: a fraction of the other sites' training records copied to the referral site,
half exact, half with one word or one measurement changed, labels kept."""

from __future__ import annotations

import pytest
import torch

from hydrafl.data import DataError, load_cohort


@pytest.mark.parametrize("task", ["clinical-text", "tabular"])
def test_copies_of_a_fraction_of_the_other_sites_records_land_at_site_0(task):
    plain = load_cohort(task, num_sites=3, samples_per_site=100, seed=2)
    cohort = load_cohort(task, num_sites=3, samples_per_site=100, seed=2, duplicates=0.25)
    others = sum(len(site.train_y) for site in plain.sites[1:])
    assert len(cohort.planted) == round(0.25 * others)
    sizes = [len(site.train_y) for site in cohort.sites]
    assert sizes == [len(plain.sites[0].train_y) + len(cohort.planted)] + [
        len(site.train_y) for site in plain.sites[1:]
    ]
    changed = []
    for site, row, copy_site, copy_row in cohort.planted:
        assert site != copy_site == 0
        original, copy = cohort.sites[site].train_x[row], cohort.sites[0].train_x[copy_row]
        assert cohort.sites[site].train_y[row] == cohort.sites[0].train_y[copy_row]
        changed.append(int((original != copy).sum()))
    assert set(changed) == {0, 1}  # exact copies and near copies, one token or one column apart
    assert 0.3 < changed.count(1) / len(changed) < 0.7
    for site in (
        1,
        2,
    ):  # the other sites keep their own records, in order (rows standardised with the copies)
        assert torch.equal(cohort.sites[site].train_y, plain.sites[site].train_y)


def test_the_same_seed_plants_the_same_copies():
    first = load_cohort("clinical-text", num_sites=3, samples_per_site=50, duplicates=0.2)
    again = load_cohort("clinical-text", num_sites=3, samples_per_site=50, duplicates=0.2)
    assert first.planted == again.planted
    assert torch.equal(first.sites[0].train_x, again.sites[0].train_x)


@pytest.mark.parametrize(
    ("task", "sites", "message"),
    [("chest-xray", 3, "not in image records"), ("tabular", 1, "at least 2 sites")],
)
def test_duplicates_are_refused_where_they_cannot_be_planted(task, sites, message):
    with pytest.raises(DataError, match=message):
        load_cohort(task, num_sites=sites, samples_per_site=20, duplicates=0.2)
