"""The coordinator schema's Alembic migrations, and the check every open of a database goes through.

A database is at a revision of versions/ (its `alembic_version` row), empty, or "legacy": made by a hydrafl from
before these migrations, with no version row; its schema says which revision it matches. The coordinator
upgrades an older database when it opens it; admin commands refuse one (a read should not change the schema
behind a running coordinator's back), and everyone refuses a database newer than this hydrafl.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util import CommandError
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection, Engine

log = logging.getLogger(__name__)

FIRST_TABLES = frozenset(
    {"sites", "runs", "messages", "replies", "audit_events", "coordinator_lease"}
)
"""Revision 0001's tables: a legacy database holds them all."""
PG_LOCK_KEY = 0x68796472
"""The transaction-scoped advisory lock that makes coordinators opening one PostgreSQL database together
migrate it one after the other."""


class SchemaError(RuntimeError):
    """The database's schema is not one this hydrafl can use as it is; the message says what to run."""


@dataclass(frozen=True, slots=True)
class SchemaState:
    """Where a database stands: `revision` is None for an empty one; `legacy` when that revision was read
    from its tables, not from a version row."""

    revision: str | None
    head: str
    known: bool
    legacy: bool = False

    @property
    def at_head(self) -> bool:
        return self.revision == self.head

    @property
    def label(self) -> str:
        """The revision as logs say it: "empty", "0001", "0001 (unversioned)"."""
        if self.revision is None:
            return "empty"
        return f"{self.revision} (unversioned)" if self.legacy else self.revision

    def describe(self) -> str:
        """One line for `hydrafl admin db current`."""
        if self.revision is None:
            return f"empty database (this hydrafl's head is {self.head})"
        if not self.known:
            return f"{self.revision}, newer than this hydrafl's head {self.head}: upgrade hydrafl"
        legacy = ", unversioned (made before migrations)" if self.legacy else ""
        if self.at_head:
            return f"{self.revision} (head){legacy}" + (
                "; `hydrafl admin db upgrade` stamps it" if legacy else ""
            )
        return f"{self.revision}{legacy}; head is {self.head}: run `hydrafl admin db upgrade`"


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration in code: scripts from this package (wherever it is installed), on `connection`."""
    config = Config()
    config.set_main_option(
        "script_location", str(Path(__file__).parent).replace("%", "%%")
    )  # ini interpolation
    config.set_main_option("path_separator", "os")
    config.attributes["connection"] = connection
    return config


def head_revision() -> str:
    """The newest revision this hydrafl knows (what `hydrafl server` upgrades to)."""
    return _head(ScriptDirectory.from_config(alembic_config()))


def _head(scripts: ScriptDirectory) -> str:
    head = scripts.get_current_head()
    if head is None:
        raise SchemaError("this hydrafl ships no schema revisions: its installation is broken")
    return head


def schema_state(connection: Connection) -> SchemaState:
    """Read where the database stands, without changing it."""
    scripts = ScriptDirectory.from_config(alembic_config(connection))
    head = _head(scripts)
    tables = set(inspect(connection).get_table_names())
    revision = (
        MigrationContext.configure(connection).get_current_revision()
        if "alembic_version" in tables
        else None
    )
    if revision is not None:
        try:
            scripts.get_revision(revision)
        except CommandError:
            return SchemaState(revision, head, known=False)
        return SchemaState(revision, head, known=True)
    if not tables & FIRST_TABLES:
        return SchemaState(None, head, known=True)
    if missing := FIRST_TABLES - tables:
        raise SchemaError(
            f"database has hydrafl tables but not {', '.join(sorted(missing))}: it was made by a development build "
            "older than any release; start from a new database"
        )
    # create_all made 0001's schema, and 0002's once the ad-hoc `server_app` column upgrade had run
    columns = {column["name"] for column in inspect(connection).get_columns("runs")}
    return SchemaState("0002" if "server_app" in columns else "0001", head, known=True, legacy=True)


def check_usable(state: SchemaState, *, upgrade: bool) -> None:
    """Raise SchemaError unless a database in `state` may be opened (after an upgrade, when `upgrade`)."""
    if not state.known:
        raise SchemaError(
            f"database is at revision {state.revision}, newer than this hydrafl's {state.head}; upgrade hydrafl"
        )
    if not upgrade and state.revision is not None and not state.at_head:
        raise SchemaError(
            f"database is at revision {state.label}, older than this hydrafl's {state.head}; run "
            "`hydrafl admin db upgrade` (or start `hydrafl server`, which upgrades it)"
        )


def prepare_schema(engine: Engine, *, upgrade: bool) -> None:
    """Make the database usable by this hydrafl: create an empty one at head; with `upgrade`, stamp a legacy
    one and upgrade an older one; otherwise refuse (SchemaError) one older than head, and open a legacy one at
    head as it is (stamping is a write)."""
    with engine.connect() as connection:
        state = schema_state(connection)
    check_usable(state, upgrade=upgrade)
    if state.revision is None or (upgrade and (state.legacy or not state.at_head)):
        upgrade_database(engine)


def upgrade_database(engine: Engine) -> tuple[SchemaState, SchemaState]:
    """Stamp (legacy) and upgrade to head under a database-wide lock, so coordinators starting together on one
    database migrate it once; returns the states before and after."""
    with engine.connect() as connection:
        _lock(connection)
        before = schema_state(connection)
        check_usable(before, upgrade=True)
        config = alembic_config(connection)
        if before.legacy:
            assert before.revision is not None  # a legacy revision is read from its tables
            command.stamp(config, before.revision)
        if not before.at_head:
            command.upgrade(config, "head")
        after = schema_state(connection)
        connection.commit()
    where = engine.url.render_as_string(hide_password=True)
    if before.revision is None:
        log.info("database %s created at revision %s", where, after.revision)
    elif before != after:
        log.info("database %s upgraded from revision %s to %s", where, before.label, after.revision)
    return before, after


def _lock(connection: Connection) -> None:
    """Begin a transaction that holds the database's write lock until commit (DDL is transactional in both)."""
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_LOCK_KEY})
    elif connection.dialect.name == "sqlite":
        connection.exec_driver_sql("BEGIN IMMEDIATE")
