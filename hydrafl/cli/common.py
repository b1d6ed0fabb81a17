"""What the command groups share: the error console, logging, exits with a code, the --db option.

Nothing here imports torch, Flower or matplotlib: `hydrafl --help` and the admin commands load only this,
typer and rich, and each command imports what it runs when it runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

if TYPE_CHECKING:
    from hydrafl.server.store import Store

console = Console(stderr=True)
"""Errors, warnings and progress go to stderr; results (tables, JSON, tokens) to stdout."""
DbOption = Annotated[str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in $HYDRAFL_HOME).")]


def setup_logging(verbose: bool, *, quiet_rounds: bool = False) -> None:
    """Through rich on stderr: hydrafl's own events (a site joins, each round, a run ends) at INFO, and with
    --verbose its DEBUG details and Flower's INFO; other libraries say warnings only. `quiet_rounds` (simulate,
    whose progress bars or per-round lines already say it) keeps hydrafl at WARNING without --verbose."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=console, show_path=False)],
        force=True,
    )
    own = logging.DEBUG if verbose else logging.WARNING if quiet_rounds else logging.INFO
    logging.getLogger("hydrafl").setLevel(own)
    flower = logging.getLogger("flwr")
    flower.setLevel(logging.INFO if verbose else logging.WARNING)
    flower.propagate = False  # Flower has its own console handler


def fail(message: str, code: int) -> NoReturn:
    console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)


def fail_one_line(message: str, code: int) -> NoReturn:
    """Not wrapped at the terminal's width: scripts and log collectors get the whole reason on one line."""
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise typer.Exit(code)


def warn(message: str) -> None:
    console.print(f"[bold yellow]warning:[/] {escape(message)}")


def open_store(db: str | None) -> Store:
    """The coordinator's database at `db`, or the default SQLite file in $HYDRAFL_HOME (created if missing).
    An older schema is refused, not upgraded: `hydrafl admin db upgrade` or the coordinator's start does that."""
    from hydrafl.server.migrations import SchemaError
    from hydrafl.server.paths import data_dir, default_db_url
    from hydrafl.server.store import Store

    if db is None:
        data_dir().mkdir(parents=True, exist_ok=True)
    try:
        return Store(db or default_db_url(), upgrade=False)
    except SchemaError as error:
        fail_one_line(str(error), 2)
