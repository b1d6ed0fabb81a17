"""`hydrafl admin run create --server-app module:attr --run-config key=value`: a stock Flower ServerApp queued on
the coordinator's database, driven on its grid by a coordinator process with `hydrafl site --app` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from deployment import free_port, start_hydrafl, wait_serving, wait_until
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.coordinator import Coordinator
from hydrafl.server.store import Store

TESTS = Path(__file__).resolve().parents[1]
WIDE = {"COLUMNS": "200"}


def _hydrafl(*args: str, env: dict) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "hydrafl", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def _queued_stock_run(tmp_path, client_app: str) -> tuple[Store, int, dict, str]:
    """stock_flower_app's ServerApp queued by `admin run create` for 2 rounds, driven by a real coordinator
    with two real sites running `client_app`, to its end; (store, run id, env, db url)."""
    env = {
        **os.environ,
        "HYDRAFL_HOME": str(tmp_path / "home"),
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    db, address, result = (
        f"sqlite:///{tmp_path / 'coordinator.db'}",
        f"127.0.0.1:{free_port()}",
        tmp_path / "final.npz",
    )
    store = Store(db)
    tokens = [store.add_site(name)[1] for name in ("a", "b")]
    created = _hydrafl(
        "admin",
        "run",
        "create",
        "--server-app",
        "stock_flower_app:server_app",
        "--run-config",
        "num-server-rounds=2",
        "--run-config",
        f'result-path="{result}"',
        "--db",
        db,
        env=env,
    )
    assert created.returncode == 0, created.stderr
    run_id = int(created.stdout.strip())
    log = tmp_path / "coordinator.log"
    processes = [
        start_hydrafl(
            "server",
            "--listen",
            address,
            "--db",
            db,
            "--blobs",
            str(tmp_path / "blobs"),
            env=env,
            log=log,
        )
    ]
    try:
        wait_serving(address, process=processes[0])
        processes += [
            start_hydrafl(
                "site",
                "--coordinator",
                address,
                "--token",
                token,
                "--app",
                client_app,
                env=env,
                log=tmp_path / f"site-{i}.log",
            )
            for i, token in enumerate(tokens)
        ]
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            180,
            "the run did not finish",
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return store, run_id, env, db


@pytest.mark.slow
def test_a_stock_server_app_queued_by_admin_runs_on_the_coordinator_with_stock_sites(tmp_path):
    store, run_id, env, db = _queued_stock_run(tmp_path, "stock_flower_app:client_app")
    result = tmp_path / "final.npz"
    run = store.run(run_id)
    assert (run.status, run.detail, run.rounds_done) == ("finished", "", 2), (
        tmp_path / "coordinator.log"
    ).read_text()
    assert run.config == {"num-server-rounds": 2, "result-path": str(result)}
    np.testing.assert_array_equal(
        np.load(result)["w"], np.full(3, 2.0, dtype=np.float32)
    )  # 0 + 1 + 1 (FedAvg)
    assert (
        len(store.audit_events("update-accepted")) == 2 * 2 * 2
    )  # 2 rounds x train+evaluate x 2 sites
    status = _hydrafl("admin", "run", "status", str(run_id), "--db", db, env={**env, **WIDE})
    assert (
        f"run {run_id}: finished, 2/2 rounds (ServerApp stock_flower_app:server_app)"
        in status.stdout
    )
    summary = json.loads(
        _hydrafl("admin", "run", "status", str(run_id), "--json", "--db", db, env=env).stdout
    )
    assert (summary["status"], summary["rounds_done"], summary["rounds"]) == ("finished", 2, 2)
    assert summary["server_app"] == "stock_flower_app:server_app"
    # each round recorded from its replies as FedAvg aggregates them: the sites evaluate loss = mean(w) = round
    rounds = [(r["round"], r["sites_ok"], r["sites_failed"], r["loss"]) for r in summary["history"]]
    assert rounds == [(1, 2, 0, 1.0), (2, 2, 0, 2.0)]


@pytest.mark.slow
def test_a_stock_run_whose_sites_all_fail_ends_failed_with_their_reason_and_round(tmp_path):
    """Flower's FedAvg goes on through rounds of failures and returns; before, such a run ended `finished`."""
    store, run_id, _, _ = _queued_stock_run(tmp_path, "stock_flower_app:failing_client_app")
    run = store.run(run_id)
    assert run.status == "failed", (tmp_path / "coordinator.log").read_text()
    assert run.detail.startswith(
        "no site answered any of the run's 8 messages successfully: round 1, node"
    )
    assert "OSError" in run.detail  # the site's own message stays in its log
    assert [(r["round"], r["sites_ok"], r["sites_failed"]) for r in run.history] == [
        (1, 0, 4),
        (2, 0, 4),
    ]


def _create(db: str, *args: str):
    return CliRunner().invoke(app, ["admin", "run", "create", *args, "--db", db], env=WIDE)


@pytest.mark.parametrize(
    ("reference", "run_config", "reason"),
    [
        (
            "stock_flower_app:nope",
            "num-server-rounds=2",
            "module stock_flower_app has no attribute nope",
        ),
        (
            "stock_flower_app:client_app",
            "num-server-rounds=2",
            "is a ClientApp, not a flwr ServerApp",
        ),
        ("stock_flower_app", "num-server-rounds=2", "is not a module:attribute reference"),
        ("stock_flower_app:server_app", "name=unquoted text", "--run-config"),
        ("stock_flower_app:server_app", "num-server-rounds", "is not key=value"),
    ],
)
def test_run_create_refuses_a_wrong_server_app_or_run_config_in_one_line(
    tmp_path, reference, run_config, reason
):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    result = _create(db, "--server-app", reference, "--run-config", run_config)
    assert result.exit_code == 2
    assert reason in result.output
    assert len(result.output.strip().splitlines()) == 1, result.output
    assert "Traceback" not in result.output
    assert Store(db).runs() == []


def test_run_create_types_the_run_config_as_flwr_run_does(tmp_path):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    result = _create(
        db,
        "--server-app",
        "stock_flower_app:server_app",
        "--run-config",
        "num-server-rounds=3 lr=0.5",
        "--run-config",
        'name="st marys"',
        "--run-config",
        "fast=true",
    )
    assert result.exit_code == 0, result.output
    [run] = Store(db).runs()
    assert run.server_app == "stock_flower_app:server_app"
    assert run.config == {"num-server-rounds": 3, "lr": 0.5, "name": "st marys", "fast": True}
    listed = CliRunner().invoke(app, ["admin", "run", "list", "--db", db], env=WIDE).stdout
    assert "stock_flower_app:server_app" in listed and "0/3" in listed
    assert (
        _create(db, "--server-app", "stock_flower_app:server_app", "--rounds", "3").exit_code == 2
    )
    assert _create(db, "--strategy", "fedavg", "--run-config", "num-server-rounds=3").exit_code == 2


def test_a_module_missing_here_is_queued_with_a_warning_and_fails_its_run_at_drive_time(tmp_path):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    result = _create(
        db, "--server-app", "no_such_module:app", "--run-config", "num-server-rounds=2"
    )
    assert result.exit_code == 0, result.output
    assert "no module named 'no_such_module'" in result.output and "queued anyway" in result.output
    coordinator = Coordinator(
        CoordinatorConfig(
            listen="127.0.0.1:0", db_url=db, blob_dir=tmp_path / "blobs", runs_dir=tmp_path / "runs"
        )
    )
    try:
        missing = Store(db).runs()[0]
        broken = coordinator.store.create_run(
            {}, server_app="stock_flower_app:server_app"
        )  # no num-server-rounds
        coordinator.drive(missing)
        coordinator.drive(coordinator.store.run(broken.id))
    finally:
        coordinator.stop()
    assert (coordinator.store.run(missing.id).status, coordinator.store.run(missing.id).detail) == (
        "failed",
        "cannot load ServerApp 'no_such_module:app': no module named 'no_such_module'",
    )
    failed = coordinator.store.run(broken.id)
    assert failed.status == "failed"
    assert (
        failed.detail
        == "ServerApp stock_flower_app:server_app raised KeyError: 'num-server-rounds'"
    )


def test_a_database_from_before_server_app_runs_still_opens(db_url):
    store = Store(db_url)
    old = store.create_run({"strategy": "fedavg", "rounds": 3})
    with create_engine(db_url).begin() as connection:
        connection.execute(text("ALTER TABLE runs DROP COLUMN server_app"))
        connection.execute(text("ALTER TABLE runs DROP COLUMN stop_requested"))
        connection.execute(text("ALTER TABLE runs DROP COLUMN app_bundle"))  # 0004's
        connection.execute(text("DROP TABLE admin_tokens"))  # 0004's
        connection.execute(
            text("DROP INDEX ix_audit_events_kind_site")
        )  # 0003's, which no such database has
        for column in ("server_round", "count", "last_at"):
            connection.execute(text(f"ALTER TABLE audit_events DROP COLUMN {column}"))
        connection.execute(
            text("DROP TABLE alembic_version")
        )  # as made by a hydrafl from before migrations
    reopened = Store(db_url)
    assert (reopened.run(old.id).server_app, reopened.run(old.id).config) == (
        None,
        {"strategy": "fedavg", "rounds": 3},
    )
    assert (
        reopened.create_run({"num-server-rounds": 2}, server_app="app:server_app").server_app
        == "app:server_app"
    )
    assert reopened.next_run().id == old.id


def test_run_status_shows_megabytes_and_json_keeps_bytes(tmp_path):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db)
    run = store.create_run({"strategy": "fedavg", "rounds": 1})
    record = {
        "round": 1,
        "loss": 0.5,
        "accuracy": 0.75,
        "sites_ok": 2,
        "bytes_up": 2_500_000,
        "bytes_down": 1_234_567,
        "seconds": 1.5,
    }
    store.set_run_status(run.id, "running", rounds_done=1, history=[record])
    shown = (
        CliRunner()
        .invoke(app, ["admin", "run", "status", str(run.id), "--db", db], env=WIDE)
        .stdout
    )
    [row] = [line for line in shown.splitlines() if "0.7500" in line]
    assert [cell.strip() for cell in row.split("│")[1:-1]] == [
        "1",
        "0.5000",
        "0.7500",
        "2",
        "2.50",
        "1.23",
        "1.50",
    ]
    assert "MB up" in shown and "MB down" in shown
    as_json = (
        CliRunner()
        .invoke(app, ["admin", "run", "status", str(run.id), "--json", "--db", db])
        .stdout
    )
    assert json.loads(as_json)["history"][0]["bytes_up"] == 2_500_000
