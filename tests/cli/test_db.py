"""`hydrafl admin db current|upgrade`, and admin commands on a database older or newer than this hydrafl."""

from __future__ import annotations

from alembic import command
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from hydrafl.cli import app
from hydrafl.server.migrations import alembic_config, head_revision

runner = CliRunner()


def _hydrafl(*args: str):
    return runner.invoke(app, list(args))


def _at_first_revision(url: str) -> None:
    with create_engine(url).connect() as connection:
        command.upgrade(alembic_config(connection), "0001")
        connection.commit()


def test_current_and_upgrade_take_an_old_database_to_head(tmp_path):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    head = head_revision()
    _at_first_revision(db)
    current = _hydrafl("admin", "db", "current", "--db", db)
    assert current.exit_code == 1
    assert f"0001; head is {head}: run `hydrafl admin db upgrade`" in current.stdout

    refused = _hydrafl("admin", "site", "list", "--db", db)
    assert refused.exit_code == 2
    assert f"database is at revision 0001, older than this hydrafl's {head}" in refused.output

    upgraded = _hydrafl("admin", "db", "upgrade", "--db", db)
    assert (
        upgraded.exit_code == 0
        and f"database upgraded from revision 0001 to {head}" in upgraded.output
    )
    current = _hydrafl("admin", "db", "current", "--db", db)
    assert current.exit_code == 0 and current.stdout.strip() == f"{head} (head)"
    again = _hydrafl("admin", "db", "upgrade", "--db", db)
    assert again.exit_code == 0 and f"already at revision {head} (head)" in again.output
    assert _hydrafl("admin", "site", "add", "st-marys", "--db", db).exit_code == 0


def test_a_newer_database_is_refused_by_every_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRAFL_HOME", str(tmp_path / "home"))
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    assert (
        _hydrafl("admin", "db", "upgrade", "--db", db).exit_code == 0
    )  # an empty database: created at head
    with create_engine(db).begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    message = f"database is at revision 0099, newer than this hydrafl's {head_revision()}; upgrade hydrafl"
    for args in (["admin", "db", "upgrade"], ["admin", "site", "list"], ["admin", "run", "list"]):
        refused = _hydrafl(*args, "--db", db)
        assert refused.exit_code == 2 and message in " ".join(refused.output.split()), args
    current = _hydrafl("admin", "db", "current", "--db", db)
    assert current.exit_code == 1 and "0099, newer than this hydrafl's head" in current.stdout
    server = _hydrafl(
        "server", "--db", db, "--listen", "127.0.0.1:0", "--blobs", str(tmp_path / "blobs")
    )
    assert server.exit_code == 2 and message in " ".join(server.output.split())


def test_the_default_database_in_hydrafl_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HYDRAFL_HOME", str(tmp_path / "home"))
    none = _hydrafl("admin", "db", "current")  # reads: creates nothing
    assert none.exit_code == 2 and "no coordinator database" in none.output
    assert not (tmp_path / "home" / "coordinator.db").exists()
    assert _hydrafl("admin", "db", "upgrade").exit_code == 0
    assert (tmp_path / "home" / "coordinator.db").exists()
    assert _hydrafl("admin", "db", "current").stdout.strip() == f"{head_revision()} (head)"
