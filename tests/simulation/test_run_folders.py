"""Every `hydrafl simulate` writes its own folder: without --out a new one under hydrafl-runs/ with `latest`
linked to it, earlier runs untouched; an --out holding another run is refused before any training, naming
the flag; --resume continues a run in its folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

from helpers import SMALL_RUN
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.run_folders import RUNS_DIR, earlier_run
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation_config import SimulationConfig

ONE_ROUND = SMALL_RUN.replace(rounds=1, local_steps=1)


def test_each_run_gets_its_own_folder_and_latest_follows_the_newest(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = SimulationConfig(run=ONE_ROUND, strategies=("fedavg",))
    compare_strategies(first, show_progress=False)
    second = SimulationConfig(run=ONE_ROUND.replace(seed=1), strategies=("fedprox",))
    compare_strategies(second, show_progress=False)

    assert first.out != second.out and Path(first.out).parent == Path(second.out).parent == RUNS_DIR
    runs = sorted(p.name for p in RUNS_DIR.iterdir() if not p.is_symlink())
    assert runs == sorted([Path(first.out).name, Path(second.out).name])
    assert os.readlink(RUNS_DIR / "latest") == Path(second.out).name
    assert list(json.loads((Path(first.out) / "results.json").read_text())["strategies"]) == [
        "fedavg"
    ]
    assert list(json.loads((RUNS_DIR / "latest" / "results.json").read_text())["strategies"]) == [
        "fedprox"
    ]
    assert sorted(p.name for p in Path(first.out).iterdir() if p.is_dir()) == [
        "fedavg"
    ]  # no other run's folder


def test_an_out_folder_holding_a_run_is_refused_before_training_and_resume_continues_it(tmp_path):
    out = tmp_path / "study"
    common = [
        "simulate",
        "--task",
        "tabular",
        "--sites",
        "3",
        "--samples-per-site",
        "60",
        "--local-steps",
        "1",
        "--strategies",
        "fedavg",
        "--out",
        str(out),
        "--no-progress",
    ]
    runner = CliRunner()
    assert runner.invoke(app, [*common, "--rounds", "1"]).exit_code == 0
    before = (out / "results.json").read_text()

    again = runner.invoke(app, [*common, "--rounds", "2"])
    assert again.exit_code == 2
    message = " ".join(again.output.split())
    assert f"--out {out} already holds a run (results.json)" in message and "--resume" in message
    assert (out / "results.json").read_text() == before  # nothing of the earlier run was touched

    resumed = runner.invoke(app, [*common, "--rounds", "2", "--resume"])
    assert resumed.exit_code == 0, resumed.output
    assert [
        r["round"]
        for r in json.loads((out / "results.json").read_text())["strategies"]["fedavg"]["rounds"]
    ] == [0, 1, 2]


def test_a_failed_runs_checkpoint_marks_its_folder_as_taken(tmp_path):
    (tmp_path / "fedavg").mkdir()
    assert earlier_run(tmp_path) is None
    (tmp_path / "fedavg" / "checkpoint.pkl").write_bytes(b"")
    assert earlier_run(tmp_path) == "fedavg/checkpoint.pkl"
    assert earlier_run(tmp_path / "missing") is None
