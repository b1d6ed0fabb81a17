"""The synthetic tasks are learnable but not trivial, and a hospital's model transfers worse to other hospitals.

Baseline: multinomial logistic regression (bag of words for text, raw standardised values otherwise),
full-batch Adam, fixed seeds, so the numbers below are deterministic on a given torch build.
"""

import numpy as np
import pytest
import torch

from hydrafl.data import TASKS, TaskSpec, load_cohort

STEPS = 200


def _features(x: torch.Tensor, task: TaskSpec) -> torch.Tensor:
    if task.modality == "text":
        present = torch.zeros(x.shape[0], task.vocab_size)
        present.scatter_(1, x, 1.0)
        present[:, :3] = 0.0  # PAD / CLS / UNK carry no content
        return present
    return x.reshape(x.shape[0], -1)


def _fit(x: torch.Tensor, y: torch.Tensor, num_classes: int) -> torch.nn.Linear:
    model = torch.nn.Linear(x.shape[1], num_classes)
    torch.nn.init.zeros_(model.weight)
    torch.nn.init.zeros_(model.bias)
    optimiser = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-3)
    for _ in range(STEPS):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimiser.step()
    return model


def _accuracy(model: torch.nn.Linear, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


@pytest.mark.parametrize("task", TASKS)
def test_pooled_baseline_learns_but_is_not_perfect(task: str) -> None:
    cohort = load_cohort(task)
    spec = cohort.task
    train_x = torch.cat([_features(s.train_x, spec) for s in cohort.sites])
    train_y = torch.cat([s.train_y for s in cohort.sites])
    test_x = torch.cat([_features(s.test_x, spec) for s in cohort.sites])
    test_y = torch.cat([s.test_y for s in cohort.sites])
    accuracy = _accuracy(_fit(train_x, train_y, spec.num_classes), test_x, test_y)
    majority = torch.bincount(test_y).max().item() / len(test_y)
    assert accuracy > max(1.0 / spec.num_classes, majority) + 0.2
    assert accuracy < 0.95


@pytest.mark.parametrize("task", TASKS)
def test_a_site_model_transfers_worse_to_other_sites(task: str) -> None:
    cohort = load_cohort(task)
    spec = cohort.task
    own, other = [], []
    for a, site in enumerate(cohort.sites):
        model = _fit(_features(site.train_x, spec), site.train_y, spec.num_classes)
        own.append(_accuracy(model, _features(site.test_x, spec), site.test_y))
        other += [
            _accuracy(model, _features(b.test_x, spec), b.test_y)
            for k, b in enumerate(cohort.sites)
            if k != a
        ]
    # Averaged over all 4 x 3 (train site, test site) pairs to be robust to 80-row test sets.
    assert np.mean(own) - np.mean(other) > 0.08
    assert np.mean(own) > 0.65
