"""`hydrafl admin db`: the coordinator database's schema revision, and its upgrade ahead of a coordinator's
start (which would upgrade it too) or of admin commands (which refuse an older schema)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape

from hydrafl.cli.common import DbOption, console, fail_one_line

db_admin = typer.Typer(
    help="The database's schema: which revision it is at, and its upgrade.", no_args_is_help=True
)


def database_url(db: str | None, *, create: bool) -> str:
    """The URL an admin command opens: `db`, or the default SQLite file in $HYDRAFL_HOME. A SQLite file that
    does not exist is created only by a command that writes (`create`), and an explicit one only in a folder
    that exists: a typo in --db is refused, never a new empty database. Other databases are the server's to
    create. ConfigError says which, in one line."""
    from hydrafl.server.paths import data_dir, default_db_url
    from hydrafl.validation import ConfigError

    url = db or default_db_url()
    file = sqlite_file(url)
    if file is None:
        return url
    if file.exists():
        return url
    if db is None and create:
        data_dir().mkdir(parents=True, exist_ok=True)
    elif db is None:
        raise ConfigError(
            f"there is no coordinator database in {data_dir()} yet ({file} does not exist): "
            "`hydrafl admin site add NAME` or `hydrafl server` creates it; --db URL opens another"
        )
    elif not file.parent.is_dir():
        raise ConfigError(f"--db {url}: the folder {file.parent} does not exist; check --db")
    elif not create:
        raise ConfigError(
            f"--db {url}: the database {file} does not exist; check --db (`hydrafl admin db "
            "upgrade --db URL` or `hydrafl server --db URL` creates a new one)"
        )
    return url


def sqlite_file(url: str) -> Path | None:
    """The file of a SQLite URL; None for an in-memory database or another kind (ConfigError if no URL)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from hydrafl.validation import ConfigError

    try:
        parsed = make_url(url)
    except ArgumentError as error:
        raise ConfigError(
            f"--db {url!r} is not a database URL ({error}); e.g. sqlite:///coordinator.db"
        ) from None
    path = parsed.database
    if (
        parsed.get_backend_name() != "sqlite"
        or not path
        or path == ":memory:"
        or path.startswith("file:")
    ):
        return None
    return Path(path)


def _url(db: str | None, *, create: bool) -> str:
    from hydrafl.validation import ConfigError

    try:
        return database_url(db, create=create)
    except ConfigError as error:
        fail_one_line(str(error), 2)


@db_admin.command("current")
def db_current(db: DbOption = None) -> None:
    """Print the database's schema revision and whether it is this hydrafl's newest (head); exit 1 if not (exit 2:
    there is no database at --db)."""
    from sqlalchemy import create_engine

    from hydrafl.server.migrations import SchemaError, schema_state

    engine = create_engine(_url(db, create=False))
    try:
        with engine.connect() as connection:
            state = schema_state(connection)
    except SchemaError as error:
        fail_one_line(str(error), 2)
    print(state.describe())
    if state.revision is not None and not state.at_head:
        raise typer.Exit(1)


@db_admin.command("upgrade")
def db_upgrade(db: DbOption = None) -> None:
    """Upgrade the database to this hydrafl's newest schema revision (an unversioned one is stamped first)."""
    from sqlalchemy import create_engine

    from hydrafl.server.migrations import SchemaError, upgrade_database

    try:
        before, after = upgrade_database(create_engine(_url(db, create=True)))
    except SchemaError as error:
        fail_one_line(str(error), 2)
    if before == after:
        console.print(f"database already at revision {escape(after.revision or '')} (head)")
    else:
        console.print(
            f"database upgraded from revision {escape(before.label)} to {escape(after.revision or '')}"
        )
