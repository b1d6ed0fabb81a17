"""`--track`: a simulation's and a coordinator's runs read back from TensorBoard's event files and from an MLflow
store with the libraries' own readers, equal to the run's results.json and history."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from deployment import run_to_end
from helpers import SMALL_RUN
from typer.testing import CliRunner

from hydrafl import tracking
from hydrafl.cli import app
from hydrafl.rounds import RoundRecord
from hydrafl.tracking import round_metrics

QUICK = "--task tabular --sites 2 --samples-per-site 40 --local-steps 1 --rounds 2 --no-progress".split()


def _simulate(*args: str) -> None:
    result = CliRunner().invoke(app, ["simulate", *QUICK, *args])
    assert result.exit_code == 0, result.output


def _event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    events.Reload()
    return {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }


def _expected(rounds: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Per metric name, (round, value) from a run's round records, as a tracker must have logged them."""
    expected: dict[str, list[tuple[int, float]]] = {}
    for entry in rounds:
        for name, value in round_metrics(RoundRecord(**entry)).items():
            expected.setdefault(name, []).append((entry["round"], value))
    return expected


def test_round_metrics_name_every_run_wide_and_per_site_number():
    record = RoundRecord(
        round=3,
        loss=0.5,
        accuracy=0.75,
        bytes_up=10,
        seconds=1.5,
        sites_ok=2,
        dp_epsilon=1.25,
        bytes_up_per_site={"7": 4, "8": 6},
        local_epsilon_per_site={"7": 0.5},
    )
    assert round_metrics(record) == {
        "loss": 0.5,
        "accuracy": 0.75,
        "bytes_up": 10.0,
        "bytes_down": 0.0,
        "seconds": 1.5,
        "aggregation_s": 0.0,
        "sites_ok": 2.0,
        "sites_failed": 0.0,
        "dp_epsilon": 1.25,
        "site/7/bytes_up": 4.0,
        "site/8/bytes_up": 6.0,
        "site/7/local_epsilon": 0.5,
    }


def test_tensorboard_events_hold_each_strategys_rounds_config_report_and_plots(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = tmp_path / "study", tmp_path / "tb"
    _simulate("--strategies", "fedavg,fedprox", "--out", str(out), "--track", f"tensorboard:{logs}")
    results = json.loads((out / "results.json").read_text())
    for strategy in ("fedavg", "fedprox"):
        scalars = _event_scalars(logs / "study" / strategy)
        expected = _expected(results["strategies"][strategy]["rounds"])
        assert set(scalars) == set(expected)
        for name, points in expected.items():  # event files keep float32
            assert scalars[name] == [(step, float(np.float32(value))) for step, value in points]
        events = EventAccumulator(str(logs / "study" / strategy), size_guidance={"images": 0})
        events.Reload()
        assert set(events.Tags()["images"]) == {"curves_by_round", "curves_by_bytes"}
        texts = {tag.removesuffix("/text_summary") for tag in events.Tags()["tensors"]}
        assert texts == {"config", "report.md", "results.json", "rounds.tsv"}
        config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
        assert "| rounds | 2 |" in config and f"| strategy | {strategy} |" in config


def test_an_mlflow_store_holds_params_metrics_with_epsilon_and_the_report(tmp_path):
    from mlflow.tracking import MlflowClient

    out, uri = tmp_path / "dp", f"sqlite:///{tmp_path / 'mlflow.db'}"
    dp = ["--dp-noise-multiplier", "1.0", "--dp-clip", "1.0"]
    _simulate("--strategies", "fedavg", "--out", str(out), *dp, "--track", f"mlflow:{uri}")
    rounds = json.loads((out / "results.json").read_text())["strategies"]["fedavg"]["rounds"]
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("hydrafl").experiment_id])
    assert run.info.run_name == "dp/fedavg" and run.info.status == "FINISHED"
    assert run.data.params["dp-noise-multiplier"] == "1.0"
    assert run.data.params["rounds"] == "2" and run.data.params["strategy"] == "fedavg"
    expected = _expected(rounds)
    assert set(run.data.metrics) == set(expected)
    assert [value for _, value in expected["dp_epsilon"]] == [
        r["dp_epsilon"] for r in rounds if r["dp_epsilon"] is not None
    ]
    for name, points in expected.items():  # MLflow keeps doubles: equal, not close
        history = client.get_metric_history(run.info.run_id, name)
        assert sorted((m.step, m.value) for m in history) == points
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert artifacts == {
        "results.json",
        "report.md",
        "rounds.tsv",
        "curves_by_round.png",
        "curves_by_bytes.png",
    }
    assert (tmp_path / "mlartifacts").is_dir()  # beside the database, not in the working directory


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow"])
def test_a_missing_extra_is_one_line_and_exit_2_before_any_work(tmp_path, monkeypatch, kind):
    monkeypatch.setitem(tracking.TRACKERS, kind, ("hydrafl_no_such_writer", kind))
    out = tmp_path / "never"
    result = CliRunner().invoke(
        app, ["simulate", *QUICK, "--out", str(out), "--track", f"{kind}:{tmp_path / 'x'}"]
    )
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: --track {kind} needs the {kind} extra: pip install 'hydrafl[{kind}]'"
    )
    assert not out.exists()


@pytest.mark.parametrize("spec", ["wandb:runs", "tensorboard", "mlflow:"])
def test_a_bad_track_spec_names_the_two_forms(tmp_path, spec):
    result = CliRunner().invoke(app, ["server", "--track", spec, "--db", "sqlite:///x.db"])
    assert result.exit_code == 2
    assert "expected tensorboard:DIR or mlflow:URI" in " ".join(result.output.split())
    assert not (tmp_path / "x.db").exists()


@pytest.mark.slow
def test_a_coordinator_tracks_each_run_it_drives(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs = tmp_path / "tb"
    store, run_id = run_to_end(
        tmp_path,
        SMALL_RUN,
        [()] * SMALL_RUN.sites,
        server_options=("--track", f"tensorboard:{logs}"),
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    scalars = _event_scalars(logs / f"run-{run_id}")
    expected = _expected(run.history)
    assert set(scalars) == set(expected)
    for name, points in expected.items():
        assert scalars[name] == [(step, float(np.float32(value))) for step, value in points]
    events = EventAccumulator(str(logs / f"run-{run_id}"), size_guidance={"images": 0})
    events.Reload()
    assert set(events.Tags()["images"]) == {"curves_by_round", "curves_by_bytes"}
    texts = {tag.removesuffix("/text_summary") for tag in events.Tags()["tensors"]}
    assert texts == {"config", "history.json", "rounds.tsv", "push_latency.tsv"}


class _FailingTracker:
    """A tracker whose store went away after the run started."""

    def __init__(self) -> None:
        self.rounds: list[int] = []

    def log_round(self, record: RoundRecord) -> None:
        self.rounds.append(record.round)
        if record.round == 2:
            raise ConnectionError("tracking server went away")

    def log_artifacts(self, paths) -> None:
        raise AssertionError("not called once tracking stopped")

    def close(self) -> None:
        raise AssertionError("not called once tracking stopped")


def test_a_tracker_that_fails_warns_once_and_the_run_goes_on(caplog):
    failing = _FailingTracker()
    guarded = tracking.Guarded(failing)
    for server_round in range(1, 5):
        guarded.log_round(RoundRecord(round=server_round))
    guarded.log_artifacts([])
    guarded.close()
    assert failing.rounds == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.name == "hydrafl.tracking"]
    assert warnings == [
        "tracking stopped: log_round failed (ConnectionError: tracking server went away)"
    ]


def test_a_store_that_cannot_be_opened_stops_simulate_with_exit_2_before_training(tmp_path):
    (tmp_path / "a-file").write_text("")
    uri = f"sqlite:///{tmp_path / 'a-file' / 'mlflow.db'}"
    out = tmp_path / "study"
    result = CliRunner().invoke(
        app,
        [
            "simulate",
            *QUICK,
            "--strategies",
            "fedavg",
            "--out",
            str(out),
            "--track",
            f"mlflow:{uri}",
        ],
    )
    assert result.exit_code == 2
    assert f"--track mlflow:{uri}: cannot open it" in " ".join(result.output.split())
    assert not (out / "fedavg").exists()
