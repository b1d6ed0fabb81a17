"""The local trainer: deterministic batches, every inner optimizer learns, FedProx limits client drift."""

from __future__ import annotations

import pytest
import torch

from hydrafl.data import load_cohort
from hydrafl.kernels.optimizers import build_inner_optimizer
from hydrafl.models import build_model, federated_state
from hydrafl.training import LocalTrainConfig, batch_generator, batch_indices, evaluate, train_local


@pytest.fixture(scope="module")
def site():
    cohort = load_cohort("tabular", num_sites=2, samples_per_site=120, seed=1)
    return cohort.task, cohort.sites[0]


def test_batches_are_a_pure_function_of_seed_round_and_site():
    config = LocalTrainConfig(steps=7, batch_size=10, lr=1e-3)
    first = batch_indices(25, config, batch_generator(0, 3, 1))
    again = batch_indices(25, config, batch_generator(0, 3, 1))
    other = batch_indices(25, config, batch_generator(0, 4, 1))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    seen = torch.cat(first)
    assert len(seen) == 70 and set(seen[:25].tolist()) == set(range(25))  # whole epochs, shuffled


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "muon"])
def test_every_inner_optimizer_reduces_the_loss(site, optimizer):
    task, split = site
    model = build_model(task, seed=0)
    before, _ = evaluate(model, split.train_x, split.train_y)
    lr = 0.05 if optimizer == "sgd" else 3e-3
    train_local(model, split.train_x, split.train_y, LocalTrainConfig(steps=40, batch_size=32, lr=lr, optimizer=optimizer),
                batch_generator(0, 1, 0))
    after, _ = evaluate(model, split.train_x, split.train_y)
    assert after < 0.9 * before


def test_muon_takes_hidden_matrices_and_adamw_the_rest(site):
    task, _ = site
    model = build_model(task, seed=0)
    muon, adamw = build_inner_optimizer(model, "muon", lr=1e-3).optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert all(p.ndim == 2 for group in muon.param_groups for p in group["params"])
    counted = sum(len(g["params"]) for o in (muon, adamw) for g in o.param_groups)
    assert counted == len(list(model.parameters()))


def test_proximal_term_limits_drift_from_the_global_model(site):
    task, split = site
    drift = {}
    for mu in (0.0, 10.0):
        model = build_model(task, seed=0)
        start = {k: v.clone() for k, v in federated_state(model).items()}
        config = LocalTrainConfig(steps=30, batch_size=32, lr=3e-3, proximal_mu=mu)
        train_local(model, split.train_x, split.train_y, config, batch_generator(0, 1, 0))
        drift[mu] = sum(((federated_state(model)[k] - v) ** 2).sum() for k, v in start.items()).sqrt().item()
    assert drift[10.0] < 0.7 * drift[0.0]
