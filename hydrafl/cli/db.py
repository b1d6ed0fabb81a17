"""`hydrafl admin db`: the coordinator database's schema revision, and its upgrade ahead of a coordinator's
start (which would upgrade it too) or of admin commands (which refuse an older schema)."""

from __future__ import annotations

import typer
from rich.markup import escape

from hydrafl.cli.common import DbOption, console, fail_one_line

db_admin = typer.Typer(help="The database's schema: which revision it is at, and its upgrade.", no_args_is_help=True)


def _url(db: str | None) -> str:
    """`db`, or the default SQLite file (its folder made, as the other admin commands do)."""
    from hydrafl.server.paths import data_dir, default_db_url

    if db is None:
        data_dir().mkdir(parents=True, exist_ok=True)
    return db or default_db_url()


@db_admin.command("current")
def db_current(db: DbOption = None) -> None:
    """Print the database's schema revision and whether it is this hydrafl's newest (head); exit 1 if not."""
    from sqlalchemy import create_engine

    from hydrafl.server.migrations import SchemaError, schema_state

    engine = create_engine(_url(db))
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
        before, after = upgrade_database(create_engine(_url(db)))
    except SchemaError as error:
        fail_one_line(str(error), 2)
    if before == after:
        console.print(f"database already at revision {escape(after.revision)} (head)")
    else:
        console.print(f"database upgraded from revision {escape(before.label)} to {escape(after.revision)}")
