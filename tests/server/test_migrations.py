"""The coordinator schema's migrations on SQLite and PostgreSQL: an older database keeps its rows through the
upgrade, downgrade and upgrade round-trip, databases from before migrations are adopted, a newer one is refused,
and the models never drift from the head revision without a migration."""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from deployment import free_port, start_hydrafl, wait_serving, wait_until
from sqlalchemy import MetaData, create_engine, insert, inspect, text

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.server.audit import record_refusal
from hydrafl.server.migrations import (
    FIRST_TABLES,
    SchemaError,
    alembic_config,
    head_revision,
    schema_state,
)
from hydrafl.server.store import Store, hash_token
from hydrafl.server.tables import Base

HISTORY = [{"round": 1, "loss": 0.91, "accuracy": 0.6}, {"round": 2, "loss": 0.72, "accuracy": 0.7}]
ASSIGNMENT = pb.Envelope(
    message_id="m-1", message_type="train", run_id=1, round=1
).SerializeToString()
REPLY = pb.Envelope(
    reply_to_message_id="m-1", message_type="train", run_id=1, round=1
).SerializeToString()
EVENTS = [
    ("enrolled", "st-marys", None),
    ("run-finished", "", 1),
    ("revoked", "royal-infirmary", None),
]


def _migrate(url: str, action, revision: str) -> None:
    """Run an Alembic command (upgrade, downgrade, stamp) on the database at `url`, as an operator would."""
    with create_engine(url).connect() as connection:
        action(alembic_config(connection), revision)
        connection.commit()


def _state(url: str):
    with create_engine(url).connect() as connection:
        return schema_state(connection)


def _drift(url: str) -> list:
    """What autogenerate would change to make the database match the models (nothing, when they agree)."""
    with create_engine(url).connect() as connection:
        return compare_metadata(MigrationContext.configure(connection), Base.metadata)


def _first_revision_with_rows(url: str) -> None:
    """A database at revision 0001 holding what a coordinator writes: sites, a finished run with its history, a
    message and its reply, audit events. Ids come from the database (its sequences must move on PostgreSQL)."""
    _migrate(url, command.upgrade, "0001")
    engine = create_engine(url)
    tables = MetaData()
    tables.reflect(engine)
    moment = datetime(2026, 1, 5, 9, 30, tzinfo=UTC)
    with engine.begin() as connection:
        connection.execute(
            insert(tables.tables["sites"]),
            [
                {
                    "name": "st-marys",
                    "node_id": 10_001,
                    "token_hash": hash_token("t1"),
                    "revoked": False,
                    "created_at": moment,
                },
                {
                    "name": "royal-infirmary",
                    "node_id": 10_002,
                    "token_hash": hash_token("t2"),
                    "revoked": True,
                    "created_at": moment,
                },
            ],
        )
        connection.execute(
            insert(tables.tables["runs"]).values(
                config={"strategy": "fedavg", "rounds": 2},
                status="finished",
                rounds_done=2,
                history=HISTORY,
                detail="done",
                created_at=moment,
                finished_at=moment,
            )
        )
        connection.execute(
            insert(tables.tables["messages"]).values(
                message_id="m-1",
                run_id=1,
                server_round=1,
                node_id=10_001,
                envelope=ASSIGNMENT,
                created_at=moment,
                closed=False,
            )
        )
        connection.execute(
            insert(tables.tables["replies"]).values(
                reply_to_message_id="m-1",
                run_id=1,
                server_round=1,
                node_id=10_001,
                envelope=REPLY,
                accepted_at=moment,
            )
        )
        connection.execute(
            insert(tables.tables["audit_events"]),
            [
                {"at": moment, "kind": kind, "site_name": site, "run_id": run, "detail": ""}
                for kind, site, run in EVENTS
            ],
        )


def _assert_rows_kept(store: Store) -> None:
    assert [(s.name, s.node_id, s.revoked) for s in store.sites()] == [
        ("st-marys", 10_001, False),
        ("royal-infirmary", 10_002, True),
    ]
    assert store.authenticate("t1").name == "st-marys" and store.authenticate("t2") is None
    run = store.run(1)
    assert (run.config, run.status, run.rounds_done, run.history, run.detail) == (
        {"strategy": "fedavg", "rounds": 2},
        "finished",
        2,
        HISTORY,
        "done",
    )
    assert run.server_app is None  # the new column: NULL, a run of hydrafl's own ServerApp
    assert store.outbound("m-1").envelope == ASSIGNMENT
    assert [r.envelope for r in store.replies_to(["m-1"])] == [REPLY]
    assert [(e.kind, e.site_name, e.run_id) for e in store.audit_events()] == EVENTS
    assert [(e.count, e.server_round, e.last_at) for e in store.audit_events()] == [
        (1, None, None)
    ] * len(EVENTS)


def test_upgrade_from_the_first_revision_keeps_every_row(db_url, caplog):
    _first_revision_with_rows(db_url)
    assert _state(db_url).revision == "0001"
    with pytest.raises(SchemaError, match="run `hydrafl admin db upgrade`"):
        Store(
            db_url, upgrade=False
        )  # what admin commands open: an older schema is refused, not changed
    with caplog.at_level("INFO", logger="hydrafl.server.migrations"):
        store = Store(db_url)
    assert f"upgraded from revision 0001 to {head_revision()}" in caplog.text
    assert _state(db_url).revision == head_revision() and _drift(db_url) == []
    _assert_rows_kept(store)
    new = store.create_run({"num-server-rounds": 2}, server_app="app:server_app")
    assert store.run(new.id).server_app == "app:server_app"
    for _ in range(3):  # 0003: refusals of one site in one round are counted on one row
        record_refusal(store, "st-marys", "INVALID_ARGUMENT: shape", new.id, 1)
    [counted] = [e for e in store.audit_events("update-rejected") if e.run_id == new.id]
    assert (counted.count, counted.server_round) == (3, 1) and counted.last_at is not None


def test_downgrade_to_base_and_upgrade_again(db_url):
    store = Store(db_url)
    store.add_site("st-marys")
    run = store.create_run({"num-server-rounds": 1}, server_app="app:server_app")
    _migrate(db_url, command.downgrade, "0001")  # the column goes, the rows stay
    assert "server_app" not in {
        c["name"] for c in inspect(create_engine(db_url)).get_columns("runs")
    }
    _migrate(db_url, command.upgrade, "head")
    again = Store(db_url)
    assert (
        again.run(run.id).config == {"num-server-rounds": 1}
        and again.run(run.id).server_app is None
    )
    assert [s.name for s in again.sites()] == ["st-marys"]
    _migrate(db_url, command.downgrade, "base")
    assert not FIRST_TABLES & set(inspect(create_engine(db_url)).get_table_names())
    assert _state(db_url).revision is None
    _migrate(db_url, command.upgrade, "head")
    assert _state(db_url).revision == head_revision() and _drift(db_url) == []
    assert Store(db_url).sites() == []


def test_the_models_match_the_head_revision(db_url):
    """A model change without a migration fails here: autogenerate finds nothing to change at head."""
    Store(db_url)
    assert _state(db_url).revision == head_revision()
    assert _drift(db_url) == []


@pytest.mark.parametrize(
    "server_app_column", [False, True], ids=["before-server-app", "with-server-app"]
)
def test_a_database_from_before_migrations_is_stamped_and_upgraded(db_url, server_app_column):
    """What `create_all` made (the schema of 0001, or of 0002 once the ad-hoc column upgrade had run): the
    head's models without what later revisions added (0003's audit columns and index, 0004's admin tokens and
    stop requests)."""
    engine = create_engine(db_url)
    Base.metadata.create_all(engine)
    with engine.begin() as connection:
        connection.execute(text("DROP TABLE admin_tokens"))
        connection.execute(text("ALTER TABLE runs DROP COLUMN stop_requested"))
        connection.execute(text("ALTER TABLE runs DROP COLUMN app_bundle"))
        connection.execute(text("DROP INDEX ix_audit_events_kind_site"))
        for column in ("server_round", "count", "last_at"):
            connection.execute(text(f'ALTER TABLE audit_events DROP COLUMN "{column}"'))
        if not server_app_column:
            connection.execute(text("ALTER TABLE runs DROP COLUMN server_app"))
    legacy = "0002" if server_app_column else "0001"
    assert (_state(db_url).revision, _state(db_url).legacy) == (legacy, True)
    older = rf"revision {legacy} \(unversioned\), older than this hydrafl's {head_revision()}"
    with pytest.raises(SchemaError, match=older):
        Store(db_url, upgrade=False)
    Store(db_url).create_run({"strategy": "fedavg"})
    assert (_state(db_url).revision, _state(db_url).legacy) == (head_revision(), False)
    assert _drift(db_url) == []


def test_a_newer_database_is_refused_naming_both_revisions(db_url):
    Store(db_url)
    with create_engine(db_url).begin() as connection:
        connection.execute(text("UPDATE alembic_version SET version_num = '0099'"))
    message = f"database is at revision 0099, newer than this hydrafl's {head_revision()}; upgrade hydrafl"
    for upgrade in (True, False):
        with pytest.raises(SchemaError) as refused:
            Store(db_url, upgrade=upgrade)
        assert str(refused.value) == message


def test_a_database_half_made_by_a_development_build_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    Base.metadata.create_all(
        engine, tables=[Base.metadata.tables["sites"], Base.metadata.tables["runs"]]
    )
    with pytest.raises(SchemaError, match="not audit_events, coordinator_lease, messages, replies"):
        Store(url)


def test_hydrafl_server_upgrades_an_old_database_and_serves(tmp_path):
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    _first_revision_with_rows(db)
    address, log = f"127.0.0.1:{free_port()}", tmp_path / "server.log"
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path / "home")}
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
        wait_until(
            lambda: "upgraded from" in " ".join(log.read_text().split()), 10, "no upgrade logged"
        )
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert f"upgraded from revision 0001 to {head_revision()}" in " ".join(log.read_text().split())
    _assert_rows_kept(Store(db, upgrade=False))


@pytest.mark.parametrize("start", ["empty", "first-revision"])
def test_coordinators_opening_one_database_together_migrate_it_once(db_url, start):
    """Separate engines, as separate processes would have, released together by a barrier."""
    if start == "first-revision":
        _first_revision_with_rows(db_url)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def open_store() -> None:
        barrier.wait()
        try:
            Store(db_url)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=open_store) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert _state(db_url).revision == head_revision() and _drift(db_url) == []
