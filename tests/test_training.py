"""The local trainer: deterministic batches, every inner optimizer learns, FedProx limits client drift."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from spawned_ranks import RankOneDiesOnFirstAttempt

from hydrafl.client import training
from hydrafl.client.training import evaluate, site_seed, train_flops_per_sample, train_site
from hydrafl.data import load_cohort
from hydrafl.kernels.distributed import train_distributed
from hydrafl.kernels.elastic_loader import ElasticLoader
from hydrafl.kernels.lm_dual import HeadLM
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.kernels.optimizers import build_inner_optimizer
from hydrafl.losses import classification_loss
from hydrafl.models import build_model, federated_state
from hydrafl.strategies.fedprox_site import Proximal


@pytest.fixture(scope="module")
def site():
    cohort = load_cohort("tabular", num_sites=2, samples_per_site=120, seed=1)
    return cohort.task, cohort.sites[0]


def _train(model, split, config, **kwargs):
    state = {k: v.clone() for k, v in federated_state(model).items()}
    return train_site(model, state, split.train_x, split.train_y, config, device="cpu", **kwargs)


def test_batches_are_a_pure_function_of_seed_round_and_site(site):
    task, split = site

    def data_hash(seed, server_round):
        config = LocalTraining(
            steps=7, batch_size=32, lr=1e-3, seed=seed, server_round=server_round
        )
        return _train(build_model(task, seed=0), split, config).data_hash

    assert data_hash(site_seed(0, 1), 3) == data_hash(site_seed(0, 1), 3)
    assert (
        len(
            {
                data_hash(site_seed(0, 1), 3),
                data_hash(site_seed(0, 1), 4),
                data_hash(site_seed(0, 2), 3),
            }
        )
        == 3
    )


@pytest.mark.parametrize("optimizer", ["adamw", "sgd", "muon"])
def test_every_inner_optimizer_reduces_the_loss(site, optimizer):
    task, split = site
    model = build_model(task, seed=0)
    before, _ = evaluate(model, split.train_x, split.train_y)
    lr = 0.05 if optimizer == "sgd" else 3e-3
    result = _train(
        model,
        split,
        LocalTraining(steps=40, batch_size=32, lr=lr, optimizer=optimizer, server_round=1),
    )
    assert result.num_examples == 40 * 32 and result.mfu is None  # CPU: throughput only
    after, _ = evaluate(model, split.train_x, split.train_y)
    assert after < 0.9 * before


def test_muon_takes_hidden_matrices_and_adamw_the_rest(site):
    task, _ = site
    model = build_model(task, seed=0)
    muon, adamw = build_inner_optimizer(model, "muon", lr=1e-3).optimizers
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    on_muon = {id(p) for group in muon.param_groups for p in group["params"]}
    expected = {  # the hidden matrices of attention and FFN; embeddings, the feature map, head, 1-D on AdamW
        name
        for name, p in model.named_parameters()
        if p.ndim == 2
        and name.split(".")[-2] in ("query", "key", "value", "dense")
        and "encoder.layer." in name
    }
    assert (
        expected and {name for name, p in model.named_parameters() if id(p) in on_muon} == expected
    )
    counted = sum(len(g["params"]) for o in (muon, adamw) for g in o.param_groups)
    assert counted == len(list(model.parameters()))


def test_proximal_term_limits_drift_from_the_global_model(site):
    task, split = site
    drift = {}
    for mu in (0.0, 10.0):
        model = build_model(task, seed=0)
        start = {k: v.clone() for k, v in federated_state(model).items()}
        config = LocalTraining(steps=30, batch_size=32, lr=3e-3, server_round=1)
        _train(model, split, config, loss_fn=Proximal(classification_loss, mu, start))
        drift[mu] = (
            sum(((federated_state(model)[k] - v) ** 2).sum() for k, v in start.items())
            .sqrt()
            .item()
        )
    assert drift[10.0] < 0.7 * drift[0.0]


def test_lm_dual_trains_only_the_head_and_equals_its_steps_taken_by_hand(site):
    task, split = site
    model = build_model(task, seed=0)
    start = {k: v.clone() for k, v in federated_state(model).items()}
    # Gauss-Newton on a 195-parameter head wants batches of its size (small ones overfit each batch)
    config = LocalTraining(
        steps=4, batch_size=96, lr=1.0, optimizer="lm-dual", seed=3, server_round=2
    )
    before, _ = evaluate(model, split.train_x, split.train_y)
    result = _train(model, split, config)
    changed = sorted(name for name in start if not torch.equal(result.end_state[name], start[name]))
    assert changed == [
        "net.head.bias",
        "net.head.weight",
    ]  # the body and the feature tokens never move
    after, _ = evaluate(model, split.train_x, split.train_y)
    assert after < before

    reference = build_model(
        task, seed=0
    )  # the same steps by hand: the loader's batches, pass after pass
    head_lm = HeadLM(reference, reference.head())
    batch, steps = min(96, len(split.train_x)), 0
    for epoch in range(4):
        loader = ElasticLoader(
            len(split.train_x),
            global_batch_size=batch,
            lanes=1,
            world_size=1,
            seed=3,
            server_round=2,
            epoch=epoch,
        )
        for ids in loader:
            if steps < 4:
                idx = torch.as_tensor(ids)
                head_lm.step(split.train_x[idx], split.train_y[idx])
                steps += 1
    assert steps == 4
    for name, tensor in reference.net.head.state_dict().items():
        torch.testing.assert_close(result.end_state[f"net.head.{name}"], tensor, rtol=0, atol=0)


def test_lm_dual_refuses_several_processes():
    with pytest.raises(ValueError, match="lm-dual fine-tunes the head in one process"):
        LocalTraining(steps=1, batch_size=32, lr=1.0, optimizer="lm-dual", nproc=2, lanes=2)


@pytest.mark.slow
def test_a_site_whose_training_process_dies_replays_the_round_when_restarts_are_allowed(site):
    task, split = site
    build = functools.partial(build_model, task, seed=0)
    config = LocalTraining(steps=3, batch_size=8, lr=1e-2, nproc=2, max_restarts=1)
    undisturbed = _train(build(), split, config, rebuild=build)
    restarted = _train(build(), split, config, rebuild=build, loss_fn=RankOneDiesOnFirstAttempt())
    assert (undisturbed.restarts, restarted.restarts) == (0, 1)
    assert restarted.data_hash == undisturbed.data_hash
    for name, tensor in undisturbed.end_state.items():
        torch.testing.assert_close(restarted.end_state[name], tensor, rtol=0, atol=0)


def test_restarts_cannot_be_negative():
    with pytest.raises(ValueError, match="max_restarts=-1"):
        LocalTraining(steps=3, batch_size=8, lr=1e-2, max_restarts=-1)


def test_a_site_on_a_listed_gpu_reports_its_mfu(site, monkeypatch):
    """No GPU here: the trainer's result is relabelled as an H100 run, and the MFU must be the achieved FLOP/s
    of that run over the H100's peak (fp32: 67 TFLOP/s)."""

    def on_an_h100(*args, **kwargs):
        return dataclasses.replace(
            train_distributed(*args, **kwargs), device_name="NVIDIA H100 80GB HBM3"
        )

    monkeypatch.setattr(training, "train_distributed", on_an_h100)
    task, split = site
    model = build_model(task, seed=0)
    result = _train(model, split, LocalTraining(steps=2, batch_size=16, lr=1e-3))
    flops = train_flops_per_sample(model, split.train_x)
    assert flops > 0 and result.mfu == pytest.approx(
        result.samples_per_s * flops / 67e12, rel=1e-12
    )
