"""The ClientApp's replies: a delta of exactly the local training, FedProx honoured, evaluation, probes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from helpers import SMALL_RUN

from hydrafl.arrays import from_record
from hydrafl.client import site_app
from hydrafl.client.training import site_seed, train_site
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.models import build_model, federated_state
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid

CFG = SMALL_RUN.replace(sites=2, samples_per_site=50, rounds=15, local_steps=4, batch_size=8)


@pytest.fixture
def grid():
    return InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())


def _ask(grid, message_type, node, arrays=None, **config):
    content = RecordDict({"config": ConfigRecord({**CFG.to_flower(), **config})})
    if arrays is not None:
        content["arrays"] = arrays
    [reply] = grid.send_and_receive([Message(content, dst_node_id=node, message_type=message_type)])
    assert not reply.has_error(), reply.error.reason
    return reply


def test_train_reply_is_start_minus_end_of_local_training(grid):
    node = max(grid.get_node_ids())
    initial = server_app.request_initial_arrays(grid, CFG)
    reply = _ask(grid, "train", node, initial, **{"server-round": 2})
    delta = from_record(reply.content["arrays"])

    cohort = site_app.run_cohort(CFG)
    split = cohort.sites[1]
    model = build_model(cohort.task, seed=CFG.seed)
    start = {k: v.clone() for k, v in federated_state(model).items()}
    local = LocalTraining(
        steps=4, batch_size=8, lr=3e-3, seed=site_seed(CFG.seed, 1), server_round=2
    )
    train_site(model, start, split.train_x, split.train_y, local)
    for name, value in federated_state(model).items():
        torch.testing.assert_close(delta[name], start[name] - value)
    assert reply.content["metrics"]["num-examples"] == len(split.train_y)


def test_fedprox_proximal_mu_from_the_strategy_shrinks_the_update(grid):
    node = min(grid.get_node_ids())
    initial = server_app.request_initial_arrays(grid, CFG)
    norms = {}
    for mu in (0.0, 50.0):
        delta = from_record(
            _ask(
                grid, "train", node, initial, **{"strategy": "fedprox", "proximal-mu": mu}
            ).content["arrays"]
        )
        norms[mu] = float(sum((d**2).sum() for d in delta.values()))
    assert norms[50.0] < 0.5 * norms[0.0]


def test_evaluate_and_probes(grid):
    node = min(grid.get_node_ids())
    initial = server_app.request_initial_arrays(grid, CFG)
    again = server_app.request_initial_arrays(grid, CFG)
    for name, array in initial.items():
        np.testing.assert_array_equal(array.numpy(), again[name].numpy())
    metrics = _ask(grid, "evaluate", node, initial).content["metrics"]
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["loss"] > 0
    assert metrics["num-examples"] == len(site_app.run_cohort(CFG).sites[0].test_y)
    probe = _ask(grid, "query.curvature", node, initial).content["metrics"]
    assert probe["curvature"] > 0 and probe["curvature-var"] >= 0


def test_a_streamed_site_sends_the_in_memory_delta():
    """`stream-layers` from the run config: the same SGD delta bit for bit, with the window's peak reported."""
    sgd = CFG.replace(inner_optimizer="sgd", lr=0.05)
    replies = {}
    for streamed in (False, True):
        cfg = sgd.replace(stream_layers=streamed, window=1)
        grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
        initial = server_app.request_initial_arrays(grid, cfg)
        content = RecordDict({"config": ConfigRecord({**cfg.to_flower(), "server-round": 1})})
        content["arrays"] = initial
        message = Message(content, dst_node_id=min(grid.get_node_ids()), message_type="train")
        [replies[streamed]] = grid.send_and_receive([message])
        assert not replies[streamed].has_error(), replies[streamed].error.reason
    kept, streamed = (from_record(replies[s].content["arrays"]) for s in (False, True))
    assert max(float(np.abs(d).max()) for d in kept.values()) > 0
    for name in kept:
        np.testing.assert_array_equal(streamed[name], kept[name])
    assert "stream-peak-bytes" not in replies[False].content["metrics"]
    assert replies[True].content["metrics"]["stream-peak-bytes"] > 0
