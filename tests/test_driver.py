"""The round driver on the real hydrafl app: determinism, resume, the min-sites rule, hostile replies; and on
sites that only send deltas: replies streamed to the strategy one at a time, in O(model) memory."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from helpers import SMALL_RUN, make_reply

from hydrafl.arrays import from_record, to_record, weights_from_delta
from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.server.aggregation.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hydrafl.server.aggregation.driver import DriverConfig, RoundDriver, RoundFailed
from hydrafl.server.aggregation.flower_adapter import FlowerAdapter, HeldArray
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import DiLoCo
from hydrafl.strategies.diloco import DiLoCoConfig

TIMING_KEYS = {"seconds", "aggregation_s", "gap_s"}


def _run(cfg, client_app=site_app.client_app):
    grid = InProcessGrid(client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg)


def _numbers(history):
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in history]


def _site_app(train_override) -> ClientApp:
    """hydrafl's ClientApp with the train handler of one site replaced."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if context.node_config["partition-id"] == 0:
            return train_override(message, context)
        return site_app.train(message, context)

    app.evaluate()(site_app.evaluate_site)
    app.query("init")(site_app.initial_model)
    return app


def test_same_seed_gives_identical_numbers(small_run):
    cfg = small_run.replace(run_dir="")
    first, second = _run(cfg), _run(cfg)
    assert _numbers(first.history) == _numbers(second.history)
    for name, array in first.arrays.items():
        np.testing.assert_array_equal(array.numpy(), second.arrays[name].numpy())
    assert first.history[-1]["loss"] < first.history[0]["loss"]  # it learns
    assert len(first.history) == cfg.rounds + 1


@pytest.mark.slow
def test_resume_ends_with_the_same_numbers_as_an_uninterrupted_run(small_run, tmp_path):
    cfg = small_run.replace(strategy="diloco", rounds=2, outer_lr=0.5, outer_momentum=0.9)
    full = _run(cfg.replace(run_dir=str(tmp_path / "full")))
    _run(
        cfg.replace(rounds=1, run_dir=str(tmp_path / "split"))
    )  # the second round runs on the saved momentum
    resumed = _run(cfg.replace(resume=True, run_dir=str(tmp_path / "split")))
    assert _numbers(resumed.history) == _numbers(full.history)
    for name, array in full.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())
    tsv = (tmp_path / "split" / "rounds.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[:4] == ["round", "duration_s", "aggregation_s", "gap_s"]
    assert [line.split("\t")[0] for line in tsv[1:]] == ["0", "1", "2"]


def test_a_resumed_run_asks_no_site_for_the_initial_model_or_a_curvature_probe(small_run):
    """A restarted coordinator has the model in its checkpoint: a second `query.init` (to whichever site connected
    first) would be one more accepted update than the uninterrupted run had."""
    cfg = small_run.replace(strategy="diloco", outer_lr=0.5, outer_momentum=0.9)
    _run(cfg.replace(rounds=1))
    queries = []

    def counting_app() -> ClientApp:
        app = ClientApp()
        app.train()(site_app.train)
        app.evaluate()(site_app.evaluate_site)

        @app.query("curvature")
        def curvature(message: Message, context: Context) -> Message:
            queries.append("curvature")
            return site_app.curvature(message, context)

        app.query("init")(
            lambda message, context: (
                queries.append("init") or site_app.initial_model(message, context)
            )
        )
        return app

    resumed = _run(cfg.replace(rounds=2, resume=True), counting_app())
    assert [record["round"] for record in resumed.history] == [0, 1, 2]
    assert queries == []
    _run(cfg.replace(rounds=1, run_dir=""), counting_app())
    assert (
        queries == ["init"] + ["curvature"] * cfg.sites
    )  # the same app asks both on a fresh start


def test_resume_refuses_a_changed_configuration(small_run):
    _run(small_run.replace(rounds=1))
    with pytest.raises(CheckpointError, match="lr"):
        _run(small_run.replace(rounds=2, lr=0.5, resume=True))


def test_resume_of_a_checkpoint_older_than_a_key_goes_on_while_the_key_is_at_its_default(
    small_run, caplog
):
    """A coordinator upgraded mid-run: its checkpoint lacks a key a later hydrafl added."""
    run_dir = Path(small_run.run_dir)
    _run(small_run.replace(rounds=1))
    old = load_checkpoint(run_dir)
    written_before = {k: v for k, v in old.run_config.items() if k != "weight-decay"}
    save_checkpoint(run_dir, dataclasses.replace(old, run_config=written_before))
    resumed = _run(small_run.replace(rounds=2, resume=True))
    assert [record["round"] for record in resumed.history] == [0, 1, 2]
    assert "they take their defaults: weight-decay=0.0" in caplog.text
    save_checkpoint(run_dir, dataclasses.replace(old, run_config=written_before))
    with pytest.raises(
        CheckpointError, match="weight-decay"
    ):  # set to something else: not the run it was
        _run(small_run.replace(rounds=2, resume=True, weight_decay=0.1))


def test_round_with_too_few_successful_sites_fails_the_run(small_run):
    def crash(message: Message, context: Context) -> Message:
        raise RuntimeError("disk full")

    with pytest.raises(RoundFailed, match="only 2 of 3 sites replied without error, 3 required"):
        _run(small_run, _site_app(crash))
    result = _run(small_run.replace(min_sites=2), _site_app(crash))
    assert [r["sites_failed"] for r in result.history[1:]] == [1, 1, 1]
    assert [r["sites_ok"] for r in result.history[1:]] == [2, 2, 2]


@pytest.fixture(scope="module")
def honest_final_loss() -> float:
    """The last loss of the run the corruption tests corrupt, with every site honest."""
    return _run(SMALL_RUN.replace(min_sites=2), _site_app(site_app.train)).history[-1]["loss"]


@pytest.mark.parametrize("corruption", ["nan", "shape", "unknown"])
def test_invalid_updates_are_rejected_before_aggregation(small_run, corruption, honest_final_loss):
    def corrupt(message: Message, context: Context) -> Message:
        reply = site_app.train(message, context)
        delta = from_record(reply.content["arrays"])
        name = next(iter(delta))
        if corruption == "nan":
            delta[name][...] = float("nan")
        elif corruption == "shape":
            delta[name] = delta[name].reshape(-1)[:-1]
        else:
            delta["not.a.parameter"] = delta[name]
        reply.content["arrays"] = to_record(delta)
        return reply

    result = _run(small_run.replace(min_sites=2, run_dir=""), _site_app(corrupt))
    assert [r["sites_failed"] for r in result.history[1:]] == [1, 1, 1]
    assert np.isfinite([r["loss"] for r in result.history]).all()
    assert honest_final_loss != result.history[-1]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("task", ["clinical-text", "chest-xray", "tabular"])
def test_every_task_trains_federated(small_run, task):
    cfg = small_run.replace(
        task=task, samples_per_site=100, rounds=4, local_steps=10, lr=1e-3, run_dir=""
    )
    history = _run(cfg).history
    assert (
        history[-1]["train_loss"] < history[1]["train_loss"]
    )  # each round starts from a better global model
    assert all(r["sites_ok"] == cfg.sites for r in history)


def test_diloco_warns_before_training_when_predicted_unstable(small_run, caplog):
    unstable = small_run.replace(strategy="diloco", rounds=1, outer_lr=50.0)
    _run(unstable)
    assert "predicted UNSTABLE" in caplog.text
    verdict = json.loads((Path(unstable.run_dir) / "stability.json").read_text())
    assert verdict["stable"] is False and 0 < verdict["max_stable_outer_lr"] < 50.0
    caplog.clear()
    stable = unstable.replace(outer_lr=verdict["max_stable_outer_lr"] / 4, run_dir="")
    _run(stable)
    assert "predicted UNSTABLE" not in caplog.text


def _delta_app(crashing: frozenset[int] = frozenset()) -> ClientApp:
    """Sites that train nothing: each replies with a small constant delta of the model's shapes; the sites of
    these partition ids raise instead."""
    app = ClientApp()

    @app.train()
    def train(message: Message, context: Context) -> Message:
        if context.node_config["partition-id"] in crashing:
            raise RuntimeError("disk full")
        delta = {
            name: Array(np.full(tuple(a.shape), 1e-3, dtype=np.float32))
            for name, a in message.content["arrays"].items()
        }
        metrics = MetricRecord({"num-examples": 1, "train_loss": 0.5})
        return Message(
            RecordDict({"arrays": ArrayRecord(delta), "metrics": metrics}), reply_to=message
        )

    return app


def _diloco(sites: int) -> dict:
    """DiLoCo's settings for a round over all `sites`, without federated evaluation."""
    return {
        "config": DiLoCoConfig(outer_lr=1.0, outer_momentum=0.0),
        "fraction_evaluate": 0.0,
        "min_available_nodes": sites,
        "min_train_nodes": sites,
    }


class _CountingGrid(InProcessGrid):
    """The in-process grid, counting the train replies it has produced."""

    produced = 0

    def send_and_receive(self, messages, *, timeout=None):
        for reply in super().send_and_receive(messages, timeout=timeout):
            self.produced += 1
            yield reply


class _RecordingDiLoCo(DiLoCo):
    """DiLoCo, noting how many replies the grid had produced each time it pulled one."""

    def __init__(self, grid: _CountingGrid, **kwargs) -> None:
        super().__init__(**kwargs)
        self.grid = grid
        self.produced_at_pull: list[int] = []

    def aggregate_train(self, server_round, replies):
        def pulled():
            for reply in replies:
                self.produced_at_pull.append(self.grid.produced)
                yield reply

        return super().aggregate_train(server_round, pulled())


def test_the_strategy_gets_each_valid_reply_before_the_next_site_runs():
    grid = _CountingGrid(_delta_app(crashing=frozenset({1})), 4)
    strategy = _RecordingDiLoCo(grid, **_diloco(4))
    start = ArrayRecord({"w": Array(np.zeros((3, 2), dtype=np.float32))})
    result = RoundDriver(grid, strategy, DriverConfig(num_rounds=1, required_sites=3)).run(
        lambda: start
    )
    assert strategy.produced_at_pull == [
        1,
        3,
        4,
    ]  # reply k pulled before reply k+1 was produced; site 2 failed
    assert (result.history[1]["sites_ok"], result.history[1]["sites_failed"]) == (3, 1)
    np.testing.assert_allclose(result.arrays["w"].numpy(), np.full((3, 2), -1e-3, dtype=np.float32))


def test_a_streamed_round_with_too_few_valid_replies_is_discarded(tmp_path):
    grid = InProcessGrid(_delta_app(crashing=frozenset({1, 2})), 3)
    start = ArrayRecord({"w": Array(np.zeros((3, 2), dtype=np.float32))})
    config = DriverConfig(num_rounds=2, required_sites=2, run_dir=tmp_path)
    with pytest.raises(
        RoundFailed, match="round 1: only 1 of 3 sites replied without error, 2 required"
    ):
        RoundDriver(grid, DiLoCo(**_diloco(3)), config).run(
            lambda: start
        )  # DiLoCo made a model of the one reply
    saved = load_checkpoint(tmp_path)
    assert saved.server_round == 0
    np.testing.assert_array_equal(saved.arrays["w"].numpy(), start["w"].numpy())


class _ListingDiLoCo(DiLoCo):
    """DiLoCo that takes every reply of the round before aggregating: what a list of replies costs."""

    def aggregate_train(self, server_round, replies):
        return super().aggregate_train(server_round, list(replies))


def _peak_round_bytes(strategy_class: type[DiLoCo], sites: int, model: ArrayRecord) -> int:
    """Peak traced memory of one training round over `sites`, above what was allocated before it."""
    grid = InProcessGrid(_delta_app(), sites)
    driver = RoundDriver(
        grid, strategy_class(**_diloco(sites)), DriverConfig(num_rounds=1, required_sites=sites)
    )
    tracemalloc.start()
    try:
        driver.run(lambda: model)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_streamed_round_holds_o_model_memory_whatever_the_number_of_sites():
    model = ArrayRecord(
        {f"layer{i}": Array(np.zeros((512, 1024), dtype=np.float32)) for i in range(4)}
    )
    model_bytes = 4 * 512 * 1024 * 4
    growth = _peak_round_bytes(DiLoCo, 8, model) - _peak_round_bytes(DiLoCo, 2, model)
    listed = _peak_round_bytes(_ListingDiLoCo, 8, model) - _peak_round_bytes(
        _ListingDiLoCo, 2, model
    )
    assert listed > 4 * model_bytes  # the measurement sees the 6 more replies a list holds
    assert growth < model_bytes / 4, (
        f"8 sites took {growth / model_bytes:.2f} model sizes more than 2"
    )


def _site_deltas(sites: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [{"w": rng.normal(size=(4, 3)), "b": rng.normal(size=(3,))} for _ in range(sites)]


def test_flowers_strategies_get_the_same_weights_in_memory_as_serialised():
    """The adapter hands Flower's FedAvg each site's end weights without encoding them: the model is the one
    Flower makes from serialised weights (start - delta), bit for bit, and plain Arrays come out."""
    start = to_record({"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    deltas = _site_deltas(3)
    replies = [make_reply(d, 10.0 * (i + 1), node_id=i + 1) for i, d in enumerate(deltas)]
    held, _ = FlowerAdapter(FedAvg()).aggregate_train(1, replies, start, summed=False)
    serialised = [make_reply(d, 10.0 * (i + 1), node_id=i + 1) for i, d in enumerate(deltas)]
    for reply in serialised:
        reply.content["arrays"] = weights_from_delta(start, reply.content["arrays"])
    expected, _ = FedAvg().aggregate_train(1, serialised)
    for name in ("w", "b"):
        assert type(held[name]) is not HeldArray
        assert held[name].data == expected[name].data


class _FirstSite(FedAvg):
    """A selection rule: the first reply's weights, as they came."""

    def aggregate_train(self, server_round, replies):
        return next(iter(replies)).content["arrays"], None


def test_a_model_made_of_a_replys_own_weights_leaves_the_adapter_serialised():
    start = to_record({"w": np.ones((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    [delta] = _site_deltas(1)
    arrays, _ = FlowerAdapter(_FirstSite()).aggregate_train(
        1, [make_reply(delta, 1.0)], start, summed=False
    )
    assert {type(array) for array in arrays.values()} == {Array}
    np.testing.assert_array_equal(arrays["w"].numpy(), 1 - delta["w"].astype(np.float32))
