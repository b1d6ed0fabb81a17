"""SCAFFOLD: the site half's corrected steps and option II control update, the coordinator's step on x and c
against hand computations, site state across rounds, a resumed run equal to an uninterrupted one, refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from helpers import SMALL_RUN, FakeGrid, assert_same_numbers_on_ray, assert_same_numbers_over_grpc

from hydrafl.arrays import from_record, to_record
from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies.registry import reply_arrays, site_half
from hydrafl.strategies.scaffold import Scaffold
from hydrafl.strategies.scaffold_site import CONTROL, SITE_CONTROL, Corrected, ScaffoldSite
from hydrafl.updates import REPLY_ARRAYS, InvalidUpdate, check_train_reply
from hydrafl.validation import ConfigError

CFG = SMALL_RUN.replace(strategy="scaffold", inner_optimizer="sgd", lr=0.05, rounds=3)


def _mse(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def test_the_site_finds_the_half_by_name_and_the_reply_declares_the_control_change():
    assert site_half("scaffold") is ScaffoldSite and reply_arrays("scaffold") == (CONTROL,)
    assert reply_arrays("fedavg") == () and site_half("fedavg") is None


def test_the_linear_term_adds_exactly_c_minus_ci_to_the_gradient_and_nothing_to_the_loss():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    correction = {"weight": torch.tensor([[0.5, -1.0, 2.0]]), "bias": torch.tensor([0.25])}
    plain = _mse(model, x, y)
    plain.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    corrected = Corrected(_mse, correction)(model, x, y)
    corrected.backward()
    assert corrected.item() == plain.item()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name] + correction[name], rtol=0, atol=1e-7)


def test_option_ii_control_update_and_the_site_state_across_rounds():
    """c_i+ = c_i - c + (x - y) / (K eta); the reply carries c_i+ - c_i and the site keeps c_i+ for the next
    round, whose correction is c - c_i+."""
    state = RecordDict()
    start = {"w": torch.tensor([1.0, 2.0])}
    c = {"w": torch.tensor([0.1, -0.2])}
    end = {"w": torch.tensor([0.9, 2.3])}
    half = ScaffoldSite({}, state, {"arrays": to_record(start), CONTROL: to_record(c)})
    records, metrics = half.reply(start, end, steps=4, lr=0.5)
    expected = 0 - c["w"] + (start["w"] - end["w"]) / (4 * 0.5)
    torch.testing.assert_close(from_record(state[SITE_CONTROL])["w"], expected)
    torch.testing.assert_close(from_record(records[CONTROL])["w"], expected)
    assert metrics == {}
    later = ScaffoldSite({}, state, {CONTROL: to_record(c)})
    loss = later.loss(_mse, start)
    torch.testing.assert_close(loss.correction["w"], c["w"] - expected)


def test_the_coordinator_steps_x_by_the_weighted_mean_delta_and_c_by_the_sum_over_all_sites():
    grid = FakeGrid([1, 2, 3, 4])  # N = 4 sites connected, 2 of them answer
    strategy = Scaffold(server_lr=0.5, min_available_nodes=1, min_train_nodes=1)
    x = {"w": np.array([1.0, -1.0], dtype=np.float32)}
    messages = list(strategy.configure_train(1, to_record(x), ConfigRecord(), grid))
    assert all(m.content["config"][REPLY_ARRAYS] == [CONTROL] for m in messages)
    assert all(not from_record(m.content[CONTROL])["w"].any() for m in messages)  # c starts at 0
    replies = [
        _site_reply({"w": [0.2, 0.4]}, {"w": [1.0, 2.0]}, 1.0),
        _site_reply({"w": [0.8, -0.4]}, {"w": [3.0, -2.0]}, 3.0),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    mean_delta = (1.0 * np.array([0.2, 0.4]) + 3.0 * np.array([0.8, -0.4])) / 4.0
    np.testing.assert_allclose(from_record(arrays)["w"].numpy(), x["w"] - 0.5 * mean_delta, 1e-6)
    np.testing.assert_allclose(strategy.control["w"].numpy(), [(1 + 3) / 4, (2 - 2) / 4], 1e-6)
    assert metrics["train_loss"] == 1.0
    restored = Scaffold()
    restored.load_state_dict(strategy.state_dict())
    torch.testing.assert_close(restored.control["w"], strategy.control["w"])


def _site_reply(delta: dict, control: dict, weight: float) -> Message:
    tensors = {name: np.array(v, dtype=np.float32) for name, v in delta.items()}
    controls = {name: np.array(v, dtype=np.float32) for name, v in control.items()}
    content = RecordDict(
        {
            "arrays": to_record(tensors),
            CONTROL: to_record(controls),
            "metrics": MetricRecord({"num-examples": weight, "train_loss": 1.0}),
        }
    )
    return Message(content, dst_node_id=1, message_type="train")


def test_the_reply_check_admits_exactly_the_declared_records():
    model = to_record({"w": np.zeros(2, dtype=np.float32)})
    reply = _site_reply({"w": [0.1, 0.2]}, {"w": [0.0, 1.0]}, 2.0)
    check_train_reply(reply, model, extra_arrays=(CONTROL,))
    with pytest.raises(InvalidUpdate, match="expected 1 ArrayRecord"):
        check_train_reply(reply, model)  # a plain strategy's run admits no second record
    bare = _site_reply({"w": [0.1, 0.2]}, {}, 2.0)
    del bare.content[CONTROL]
    with pytest.raises(InvalidUpdate, match="expected 2 ArrayRecord"):
        check_train_reply(bare, model, extra_arrays=(CONTROL,))
    bad = _site_reply({"w": [0.1, 0.2]}, {"w": [np.nan, 1.0]}, 2.0)
    with pytest.raises(InvalidUpdate, match="NaN"):
        check_train_reply(bad, model, extra_arrays=(CONTROL,))


def test_a_site_reply_carries_option_ii_of_its_own_sgd_steps():
    grid = InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())
    initial = server_app.request_initial_arrays(grid, CFG)
    c = {n: torch.full_like(t, 0.01) for n, t in from_record(initial).items()}
    config = ConfigRecord({**CFG.to_flower(), "server-round": 1})
    content = RecordDict({"arrays": initial, "config": config, CONTROL: to_record(c)})
    [reply] = grid.send_and_receive(
        [Message(content, dst_node_id=min(grid.get_node_ids()), message_type="train")]
    )
    assert not reply.has_error(), reply.error.reason
    delta, change = from_record(reply.content["arrays"]), from_record(reply.content[CONTROL])
    for name in delta:  # c_i was 0: its change is -c + delta / (K eta)
        expected = -c[name] + delta[name] / (CFG.local_steps * CFG.lr)
        torch.testing.assert_close(change[name], expected, rtol=1e-5, atol=1e-6)


def test_scaffold_learns_and_a_resumed_run_equals_an_uninterrupted_one(tmp_path):
    """The coordinator stops after round 2 and resumes from its checkpoint (c restored) while the sites keep
    their c_i: round 3 ends with exactly the arrays of the uninterrupted run."""

    def run(cfg: RunConfig, grid: InProcessGrid):
        return server_app.run_federation(grid, cfg)

    straight = run(CFG.replace(run_dir=str(tmp_path / "a")), _grid())
    assert straight.history[-1]["loss"] < straight.history[0]["loss"]
    grid = _grid()
    run(CFG.replace(run_dir=str(tmp_path / "b"), rounds=2), grid)
    resumed = run(CFG.replace(run_dir=str(tmp_path / "b"), resume=True), grid)
    for name, array in straight.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())


def _grid() -> InProcessGrid:
    return InProcessGrid(site_app.client_app, CFG.sites, CFG.to_flower())


@pytest.mark.parametrize(
    ("changes", "flag"),
    [({"secagg": True}, "secagg"), ({"dp_clip": 1.0, "dp_noise_multiplier": 1.0}, "dp-clip")],
)
def test_secure_aggregation_and_central_dp_are_refused_by_name(changes, flag):
    with pytest.raises(ConfigError, match=f"--{flag}.*scaffold"):
        CFG.replace(**changes)


def test_compressed_updates_are_refused_by_name():
    with pytest.raises(ConfigError, match="--compress='int8'.*scaffold"):
        CFG.replace(compress="int8").options.build(CFG.replace(compress="int8"))


@pytest.mark.slow
def test_the_same_numbers_over_grpc_with_real_site_processes(tmp_path):
    assert_same_numbers_over_grpc(tmp_path, CFG.replace(sites=2, rounds=3))


@pytest.mark.slow
@pytest.mark.ray
def test_the_same_numbers_on_ray(tmp_path):
    assert_same_numbers_on_ray(tmp_path, CFG.replace(sites=2, rounds=3))
