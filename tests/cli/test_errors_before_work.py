"""Every name, path, port and value is refused before any heavy import or any work, the same way by `simulate`,
`admin run create` and `server`; admin commands create no database they were not asked to, and say an error
in one line (the traceback only with -v)."""

from __future__ import annotations

import os
import time

import import_probes
import pytest
from typer.testing import CliRunner

from hydrafl.cli import app

WIDE = {"COLUMNS": "200"}
HEAVY = ("torch", "transformers", "peft", "flwr", "matplotlib")


def _probe(args: list[str], tmp_path) -> tuple[int, set[str], float, str, str]:
    """Exit code, loaded modules and seconds of `hydrafl ARGS` in a fresh interpreter, and its stdout, stderr."""
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path / "home"), "COLUMNS": "200"}
    started = time.perf_counter()
    report, done = import_probes.cli(args, env, cwd=tmp_path)
    wall_s = time.perf_counter() - started
    return report["code"], set(report["modules"]), wall_s, done.stdout, done.stderr


def _flat(text: str) -> str:
    return " ".join(text.split())


def _error_line(output: str) -> str:
    return _flat(output).partition("error: ")[2]


@pytest.mark.parametrize(
    "args",
    [
        ["simulate", "--strategies", "fedavg,fedadma"],
        ["admin", "run", "create", "--strategy", "fedadma", "--db", "sqlite:///c.db"],
    ],
)
def test_a_misspelled_strategy_is_refused_before_torch_is_imported_in_under_2_s(args, tmp_path):
    code, modules, wall_s, _, stderr = _probe(args, tmp_path)
    assert code == 2 and "unknown strategy 'fedadma'" in _flat(stderr)
    assert sorted(name for name in modules if name.startswith(HEAVY)) == []
    assert wall_s < 2.0, f"{wall_s:.2f} s"
    assert not (tmp_path / "hydrafl-runs").exists() and not (tmp_path / "c.db").exists()


def test_the_names_read_from_the_strategies_sources_are_the_registered_ones():
    from hydrafl.strategies.registry import _scanned_builtins, config_class, strategy_names

    packaged = {
        name
        for name in strategy_names()
        if config_class(name).__module__.startswith("hydrafl.strategies.")
    }
    assert set(_scanned_builtins()) == packaged


@pytest.mark.parametrize("flags", [["--task", "tabuler"], ["--data", "no-such-file.csv"]])
def test_simulate_refuses_a_wrong_task_or_data_path_before_torch(flags, tmp_path):
    code, modules, _, _, stderr = _probe(["simulate", *flags], tmp_path)
    assert code == 2 and "Traceback" not in stderr
    assert sorted(name for name in modules if name.startswith(HEAVY)) == []


def test_admin_run_create_refuses_an_unknown_task_as_simulate_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = f"sqlite:///{tmp_path / 'c.db'}"
    runner = CliRunner()
    created = runner.invoke(
        app, ["admin", "run", "create", "--task", "tabuler", "--db", db], env=WIDE
    )
    simulated = runner.invoke(app, ["simulate", "--task", "tabuler"], env=WIDE)
    assert created.exit_code == simulated.exit_code == 2
    assert "unknown task 'tabuler'" in created.output
    assert _error_line(created.output) == _error_line(simulated.output)
    assert not (tmp_path / "c.db").exists()


def test_admin_on_a_database_in_a_folder_that_does_not_exist_says_one_line():
    result = CliRunner().invoke(
        app, ["admin", "run", "list", "--db", "sqlite:////no/such/dir/x.db"], env=WIDE
    )
    assert result.exit_code == 2
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    assert "/no/such/dir" in result.output


@pytest.mark.parametrize(
    "command",
    [
        ["admin", "run", "list"],
        ["admin", "run", "status", "1"],
        ["admin", "site", "list"],
        ["admin", "site", "revoke", "st-marys"],
        ["admin", "db", "current"],
        ["admin", "gc"],
        ["admin", "run", "delete", "1"],
    ],
)
def test_commands_that_read_refuse_a_database_that_does_not_exist_instead_of_creating_it(
    command, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HYDRAFL_HOME", str(tmp_path / "home"))
    result = CliRunner().invoke(app, [*command, "--db", "sqlite:///typo.db"], env=WIDE)
    assert result.exit_code == 2, result.output
    assert "typo.db" in result.output and "does not exist" in result.output
    assert not (tmp_path / "typo.db").exists()
    assert "Traceback" not in result.output


def test_commands_that_write_create_the_database_and_say_so(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(
        app, ["admin", "site", "add", "st-marys", "--db", "sqlite:///new.db"], env=WIDE
    )
    assert result.exit_code == 0 and (tmp_path / "new.db").exists()
    assert "created the database" in _flat(result.output)


def test_an_admin_command_that_fails_unexpectedly_says_one_line_and_the_traceback_only_with_v(
    tmp_path, monkeypatch
):
    from hydrafl.server.store import Store

    db = f"sqlite:///{tmp_path / 'c.db'}"
    runner = CliRunner()
    assert runner.invoke(app, ["admin", "site", "add", "st-marys", "--db", db]).exit_code == 0

    def broken(self):
        raise RuntimeError("the disk went away")

    monkeypatch.setattr(Store, "runs", broken)
    quiet = runner.invoke(app, ["admin", "run", "list", "--db", db], env=WIDE)
    assert quiet.exit_code == 1 and "Traceback" not in quiet.output
    assert _flat(quiet.output).startswith("error: RuntimeError: the disk went away")
    assert len(quiet.output.strip().splitlines()) == 1
    loud = runner.invoke(app, ["admin", "-v", "run", "list", "--db", db], env=WIDE)
    assert isinstance(loud.exception, RuntimeError)  # left to the traceback


@pytest.mark.parametrize(
    "flags",
    [
        ["--listen", "127.0.0.1:70000"],
        ["--dashboard", "127.0.0.1:99999"],
        ["--listen", "127.0.0.1:port"],
    ],
)
def test_the_server_refuses_a_port_out_of_range_before_it_starts(flags, tmp_path):
    code, modules, _, stdout, stderr = _probe(
        ["server", *flags, "--db", f"sqlite:///{tmp_path / 'c.db'}"], tmp_path
    )
    assert code == 2 and "Traceback" not in stderr
    assert "0..65535" in _flat(stderr) and flags[0] in stderr
    assert "coordinator on" not in stdout + stderr
    assert not (tmp_path / "c.db").exists()
    assert "torch" not in modules


def test_a_site_refuses_a_coordinator_port_out_of_range():
    result = CliRunner().invoke(
        app, ["site", "--token", "t", "--coordinator", "127.0.0.1:70000"], env=WIDE
    )
    assert (
        result.exit_code == 2
        and "--coordinator" in result.output
        and "0..65535" in _flat(result.output)
    )
