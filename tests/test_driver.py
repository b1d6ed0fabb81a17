"""The round driver on the real hydrafl app: determinism, resume, the min-sites rule, hostile replies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from hydrafl import server_app, site_app
from hydrafl.arrays import from_record, to_record
from hydrafl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from hydrafl.driver import RoundFailed
from hydrafl.simulation.grid import InProcessGrid

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
    cfg = dataclasses.replace(small_run, run_dir="")
    first, second = _run(cfg), _run(cfg)
    assert _numbers(first.history) == _numbers(second.history)
    for name, array in first.arrays.items():
        np.testing.assert_array_equal(array.numpy(), second.arrays[name].numpy())
    assert first.history[-1]["loss"] < first.history[0]["loss"]  # it learns
    assert len(first.history) == cfg.rounds + 1


def test_resume_ends_with_the_same_numbers_as_an_uninterrupted_run(small_run, tmp_path):
    cfg = dataclasses.replace(small_run, strategy="diloco", rounds=4, outer_lr=0.5, outer_momentum=0.9)
    full = _run(dataclasses.replace(cfg, run_dir=str(tmp_path / "full")))
    _run(dataclasses.replace(cfg, rounds=2, run_dir=str(tmp_path / "split")))
    resumed = _run(dataclasses.replace(cfg, resume=True, run_dir=str(tmp_path / "split")))
    assert _numbers(resumed.history) == _numbers(full.history)
    for name, array in full.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())
    tsv = (tmp_path / "split" / "rounds.tsv").read_text().splitlines()
    assert tsv[0].split("\t")[:4] == ["round", "duration_s", "aggregation_s", "gap_s"]
    assert [line.split("\t")[0] for line in tsv[1:]] == ["0", "1", "2", "3", "4"]


def test_resume_refuses_a_changed_configuration(small_run):
    _run(dataclasses.replace(small_run, rounds=1))
    with pytest.raises(CheckpointError, match="lr"):
        _run(dataclasses.replace(small_run, rounds=2, lr=0.5, resume=True))


def test_resume_of_a_checkpoint_older_than_a_key_goes_on_while_the_key_is_at_its_default(small_run, caplog):
    """A coordinator upgraded mid-run: its checkpoint lacks a key a later hydrafl added."""
    run_dir = Path(small_run.run_dir)
    _run(dataclasses.replace(small_run, rounds=1))
    old = load_checkpoint(run_dir)
    written_before = {k: v for k, v in old.run_config.items() if k != "hydra-lora"}
    save_checkpoint(run_dir, dataclasses.replace(old, run_config=written_before))
    resumed = _run(dataclasses.replace(small_run, rounds=2, resume=True))
    assert [record["round"] for record in resumed.history] == [0, 1, 2]
    assert "they take their defaults: hydra-lora='products'" in caplog.text
    save_checkpoint(run_dir, dataclasses.replace(old, run_config=written_before))
    with pytest.raises(CheckpointError, match="hydra-lora"):  # set to something else: not the run it was
        _run(dataclasses.replace(small_run, rounds=2, resume=True, hydra_lora="factors"))


def test_round_with_too_few_successful_sites_fails_the_run(small_run):
    def crash(message: Message, context: Context) -> Message:
        raise RuntimeError("disk full")

    with pytest.raises(RoundFailed, match="only 2 of 3 sites replied without error, 3 required"):
        _run(small_run, _site_app(crash))
    result = _run(dataclasses.replace(small_run, min_sites=2), _site_app(crash))
    assert [r["sites_failed"] for r in result.history[1:]] == [1, 1, 1]
    assert [r["sites_ok"] for r in result.history[1:]] == [2, 2, 2]


@pytest.mark.parametrize("corruption", ["nan", "shape", "unknown"])
def test_invalid_updates_are_rejected_before_aggregation(small_run, corruption):
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

    honest = _run(dataclasses.replace(small_run, min_sites=2, run_dir=""), _site_app(site_app.train))
    result = _run(dataclasses.replace(small_run, min_sites=2, run_dir=""), _site_app(corrupt))
    assert [r["sites_failed"] for r in result.history[1:]] == [1, 1, 1]
    assert np.isfinite([r["loss"] for r in result.history]).all()
    assert honest.history[-1]["loss"] != result.history[-1]["loss"]


@pytest.mark.parametrize("task", ["clinical-text", "chest-xray", "tabular"])
def test_every_task_trains_federated(small_run, task):
    cfg = dataclasses.replace(small_run, task=task, samples_per_site=100, rounds=4, local_steps=10, lr=1e-3, run_dir="")
    history = _run(cfg).history
    assert history[-1]["train_loss"] < history[1]["train_loss"]  # each round starts from a better global model
    assert all(r["sites_ok"] == cfg.sites for r in history)


def test_diloco_warns_before_training_when_predicted_unstable(small_run, caplog):
    unstable = dataclasses.replace(small_run, strategy="diloco", rounds=1, outer_lr=50.0)
    _run(unstable)
    assert "predicted UNSTABLE" in caplog.text
    verdict = json.loads((Path(unstable.run_dir) / "stability.json").read_text())
    assert verdict["stable"] is False and 0 < verdict["max_stable_outer_lr"] < 50.0
    caplog.clear()
    stable = dataclasses.replace(unstable, outer_lr=verdict["max_stable_outer_lr"] / 4, run_dir="")
    _run(stable)
    assert "predicted UNSTABLE" not in caplog.text
