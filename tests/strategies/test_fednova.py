"""FedNova: the aggregate against its formula, each site's local steps following its data size, a run on the
in-process grid with a resumed run equal to an uninterrupted one, refusals by name."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from helpers import SMALL_RUN, FakeGrid, assert_same_numbers_on_ray, assert_same_numbers_over_grpc

from hydrafl.arrays import from_record, to_record
from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies.fednova import FedNova
from hydrafl.strategies.fednova_site import LOCAL_STEPS, FedNovaSite
from hydrafl.validation import ConfigError

CFG = SMALL_RUN.replace(
    strategy="fednova",
    inner_optimizer="sgd",
    lr=0.05,
    partition="dirichlet:0.3",
    fednova_epochs=0.5,
)


def _reply(delta: list[float], weight: float, steps: float | None) -> Message:
    metrics = {"num-examples": weight, **({LOCAL_STEPS: steps} if steps is not None else {})}
    content = RecordDict(
        {
            "arrays": to_record({"w": np.array(delta, dtype=np.float32)}),
            "metrics": MetricRecord(metrics),
        }
    )
    return Message(content, dst_node_id=1, message_type="train")


def test_the_aggregate_is_the_normalised_average_scaled_by_the_mean_steps():
    strategy = FedNova(server_lr=0.5, min_available_nodes=1, min_train_nodes=1)
    x = np.array([1.0, -2.0], dtype=np.float32)
    list(strategy.configure_train(1, to_record({"w": x}), ConfigRecord(), FakeGrid([1, 2, 3])))
    replies = [
        _reply([0.4, 0.8], 10.0, 2),
        _reply([3.0, -1.5], 30.0, 6),
        _reply([9.0, 9.0], 5.0, None),  # no steps reported: left out
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    p = np.array([10.0, 30.0]) / 40.0
    tau = np.array([2.0, 6.0])
    d = np.array([[0.4, 0.8], [3.0, -1.5]]) / tau[:, None]
    expected = x - 0.5 * (p @ tau) * (p @ d)
    np.testing.assert_allclose(from_record(arrays)["w"].numpy(), expected, rtol=1e-6)


def test_equal_steps_give_fedavg_of_the_deltas():
    strategy = FedNova(min_available_nodes=1, min_train_nodes=1)
    x = np.zeros(2, dtype=np.float32)
    list(strategy.configure_train(1, to_record({"w": x}), ConfigRecord(), FakeGrid([1, 2])))
    arrays, _ = strategy.aggregate_train(
        1, [_reply([1.0, 2.0], 1.0, 4), _reply([3.0, 0.0], 3.0, 4)]
    )
    np.testing.assert_allclose(from_record(arrays)["w"].numpy(), [-2.5, -0.5], rtol=1e-6)


def test_a_sites_steps_follow_its_data_size_in_epochs_mode():
    half = FedNovaSite({"fednova-epochs": 2.0}, RecordDict())
    assert half.local_steps(5, samples=100, batch_size=16) == math.ceil(2 * 100 / 16)
    assert half.local_steps(5, samples=10, batch_size=16) == 2  # a batch is the whole split
    assert FedNovaSite({}, RecordDict()).local_steps(5, samples=100, batch_size=16) == 5
    _, metrics = half.reply({}, {}, steps=13, lr=0.1)
    assert metrics == {LOCAL_STEPS: 13.0}


def test_sites_of_different_sizes_report_different_steps_and_a_resumed_run_matches(tmp_path):
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    sizes = [len(site.train_y) for site in site_app.run_cohort(CFG).sites]
    initial = server_app.request_initial_arrays(grid, CFG)
    steps = {}
    for node, size in zip(sorted(grid.get_node_ids()), sizes, strict=True):
        content = RecordDict({"arrays": initial, "config": ConfigRecord(CFG.to_flower())})
        [reply] = grid.send_and_receive([Message(content, dst_node_id=node, message_type="train")])
        assert not reply.has_error(), reply.error.reason
        steps[size] = reply.content["metrics"][LOCAL_STEPS]
        assert steps[size] == math.ceil(0.5 * size / min(CFG.batch_size, size))
    assert len(set(steps.values())) > 1, steps  # unequal local work

    def run(cfg):
        return server_app.run_federation(
            InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
        )

    straight = run(CFG.replace(run_dir=str(tmp_path / "a")))
    assert straight.history[-1]["loss"] < straight.history[0]["loss"]
    run(CFG.replace(run_dir=str(tmp_path / "b"), rounds=CFG.rounds - 1))
    resumed = run(CFG.replace(run_dir=str(tmp_path / "b"), resume=True))
    for name, array in straight.arrays.items():
        torch.testing.assert_close(
            from_record(resumed.arrays)[name], torch.from_numpy(array.numpy()), rtol=0, atol=0
        )


@pytest.mark.parametrize(
    ("changes", "flag"),
    [({"secagg": True}, "secagg"), ({"dp_clip": 1.0, "dp_noise_multiplier": 1.0}, "dp-clip")],
)
def test_secure_aggregation_and_central_dp_are_refused_by_name(changes, flag):
    with pytest.raises(ConfigError, match=f"--{flag}.*fednova"):
        CFG.replace(**changes)


@pytest.mark.slow
def test_the_same_numbers_over_grpc_with_real_site_processes(tmp_path):
    assert_same_numbers_over_grpc(tmp_path, CFG.replace(sites=2, rounds=2))


@pytest.mark.slow
@pytest.mark.ray
def test_the_same_numbers_on_ray(tmp_path):
    assert_same_numbers_on_ray(tmp_path, CFG.replace(sites=2, rounds=2))
