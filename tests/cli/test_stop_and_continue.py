"""Stopping and continuing: Ctrl-C on `simulate` says how to continue, `--resume` without `--out` continues the
newest run (or refuses, listing the runs), and a coordinator says that it stopped and why, with one join line
per site."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from deployment import enrol, queue_run, start_hydrafl, wait_serving, wait_until
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.config import RunConfig

WIDE = {"COLUMNS": "200"}
QUICK = [
    "--task",
    "tabular",
    "--sites",
    "2",
    "--samples-per-site",
    "40",
    "--local-steps",
    "1",
    "--strategies",
    "fedavg",
    "--no-progress",
]


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_ctrl_c_prints_the_command_that_continues_the_run(tmp_path):
    out = tmp_path / "study"
    command = [
        sys.executable,
        "-m",
        "hydrafl",
        "simulate",
        "--task",
        "tabular",
        "--sites",
        "2",
        "--samples-per-site",
        "40",
        "--local-steps",
        "1",
        "--strategies",
        "fedavg",
        "--rounds",
        "400",
        "--workers",
        "1",
        "--out",
        str(out),
    ]
    env = {**os.environ, "COLUMNS": "400"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path
    )
    try:
        for line in process.stdout:  # a line per round, output not being a terminal
            if line.startswith("fedavg round 2/"):
                break
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    said = _flat(stderr)
    assert f"the partial run is in {out}" in said
    continuing = said.partition("continue it with: ")[2]
    assert shlex.split(continuing)[:2] == ["hydrafl", "simulate"]
    assert continuing.endswith(f"--out {out} --resume")
    assert "--rounds 400" in continuing and "--strategies fedavg" in continuing


def test_resume_without_out_continues_the_newest_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    first = runner.invoke(app, ["simulate", *QUICK, "--rounds", "1"], env=WIDE)
    assert first.exit_code == 0, first.output
    (run,) = [p for p in (tmp_path / "hydrafl-runs").iterdir() if p.name != "latest"]
    resumed = runner.invoke(app, ["simulate", *QUICK, "--rounds", "2", "--resume"], env=WIDE)
    assert resumed.exit_code == 0, resumed.output
    assert f"continuing hydrafl-runs/{run.name}" in _flat(resumed.output)
    assert [p.name for p in (tmp_path / "hydrafl-runs").iterdir() if p.name != "latest"] == [
        run.name
    ]
    rounds = json.loads((run / "results.json").read_text())["strategies"]["fedavg"]["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]


def test_resume_without_out_refuses_with_the_list_of_runs_when_there_is_none_to_continue(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    none = runner.invoke(app, ["simulate", *QUICK, "--resume"], env=WIDE)
    assert none.exit_code == 2 and "no run in hydrafl-runs/ to continue" in _flat(none.output)
    assert not (tmp_path / "hydrafl-runs").exists()
    for name, strategy in (("2026-01-01_10-00-00", "fedavg"), ("2026-01-02_10-00-00", "diloco")):
        (tmp_path / "hydrafl-runs" / name / strategy).mkdir(parents=True)
        (tmp_path / "hydrafl-runs" / name / strategy / "history.json").write_text("[]")
    other = runner.invoke(
        app, ["simulate", *QUICK, "--resume"], env=WIDE
    )  # the newest ran diloco, not fedavg
    said = _flat(other.output)
    assert other.exit_code == 2, other.output
    assert (
        "hydrafl-runs/2026-01-02_10-00-00 (diloco" in said
        and "hydrafl-runs/2026-01-01_10-00-00 (fedavg" in said
    )
    assert "--out" in said


def test_a_coordinator_logs_one_join_line_per_site_and_that_it_stopped_and_why(tmp_path):
    cfg = RunConfig(
        task="tabular", sites=1, samples_per_site=40, rounds=1, local_steps=1, batch_size=16
    )
    env, db, store, tokens, address = enrol(tmp_path, cfg)
    run_id = queue_run(store, cfg)
    log = tmp_path / "coordinator.log"
    server = start_hydrafl(
        "server",
        "--listen",
        address,
        "--db",
        db,
        "--blobs",
        str(tmp_path / "blobs"),
        env=env,
        log=log,
        verbose=False,
    )
    site = None
    try:
        wait_serving(address, process=server)
        site = start_hydrafl(
            "site",
            "--coordinator",
            address,
            env={**env, "HYDRAFL_SITE_TOKEN": tokens[0]},
            log=tmp_path / "site.log",
            verbose=False,
        )
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            240,
            "the run did not finish",
        )
        assert store.run(run_id).status == "finished"
        time.sleep(1)
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
    finally:
        for process in (server, site):
            if process is not None:
                process.kill()
                process.wait()
    said = log.read_text()
    assert said.count("site hospital-0 joined") == 1, said
    assert "coordinator stopped: Ctrl-C" in _flat(said), said
    assert "Traceback" not in said


@pytest.mark.parametrize("sent, why", [(signal.SIGTERM, "SIGTERM")])
def test_a_coordinator_stopped_by_sigterm_says_so(sent, why, tmp_path):
    cfg = RunConfig(task="tabular", sites=1)
    env, db, _, _, address = enrol(tmp_path, cfg)
    log = tmp_path / "coordinator.log"
    server = start_hydrafl(
        "server",
        "--listen",
        address,
        "--db",
        db,
        "--blobs",
        str(tmp_path / "blobs"),
        env=env,
        log=log,
        verbose=False,
    )
    try:
        wait_serving(address, process=server)
        server.send_signal(sent)
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
        server.wait()
    assert f"coordinator stopped: {why}" in _flat(log.read_text())
