"""What the command groups share: the error console, logging, exits with a code, the --db option.

Nothing here imports torch, Flower or matplotlib: `hydrafl --help` and the admin commands load only this,
typer and rich, and each command imports what it runs when it runs.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Annotated, NoReturn

import typer
from rich.console import Console
from rich.highlighter import NullHighlighter
from rich.logging import RichHandler
from rich.markup import escape

from hydrafl.bounded import BoundedRecords

if TYPE_CHECKING:
    from hydrafl.server.store import Store

console = Console(stderr=True)
"""Errors, warnings and progress go to stderr; results (tables, JSON, tokens) to stdout."""
DbOption = Annotated[
    str | None, typer.Option("--db", help="SQLAlchemy URL (default: SQLite in $HYDRAFL_HOME).")
]


def setup_logging(verbose: bool, *, quiet_rounds: bool = False) -> None:
    """Through rich on stderr: hydrafl's own events (a site joins, each round, a run ends) at INFO, and with
    --verbose its DEBUG details and Flower's INFO; other libraries say warnings only. `quiet_rounds` (simulate,
    whose progress bars or per-round lines already say it) keeps hydrafl at WARNING without --verbose.

    Messages quote values from outside (a site's tensor names, a coordinator's reasons), so rich neither
    highlights nor reads markup in them (its highlighter's regexes take quadratic time on a long word: 40 s for
    80,000 characters, holding the GIL), and every message is cut to MAX_LOG_CHARS (`BoundedRecords`)."""
    handler = RichHandler(
        console=console, show_path=False, highlighter=NullHighlighter(), markup=False, keywords=[]
    )
    handler.addFilter(BoundedRecords())
    logging.basicConfig(level=logging.WARNING, format="%(message)s", handlers=[handler], force=True)
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


def open_store(db: str | None, *, create: bool = False) -> Store:
    """The coordinator's database at `db`, or the default SQLite file in $HYDRAFL_HOME; only a command that
    writes (`create`) creates a missing one (`hydrafl.cli.db.database_url`), and says so. An older schema is
    refused, not upgraded: `hydrafl admin db upgrade` or the coordinator's start does that. Whatever stops it
    opening is one line, exit 2."""
    from sqlalchemy.exc import SQLAlchemyError

    from hydrafl.cli.db import database_url, sqlite_file
    from hydrafl.server.migrations import SchemaError
    from hydrafl.server.store import Store
    from hydrafl.validation import ConfigError

    try:
        url = database_url(db, create=create)
        file = sqlite_file(url)
        missing = file is not None and not file.exists()
        store = Store(url, upgrade=False)
    except (ConfigError, SchemaError) as error:
        fail_one_line(str(error), 2)
    except SQLAlchemyError as error:
        reason = str(getattr(error, "orig", None) or error).splitlines()[0]
        fail_one_line(
            f"cannot open the database {db or 'in $HYDRAFL_HOME'}: {reason}; check --db", 2
        )
    if missing:
        console.print(escape(f"created the database {url}"))
    return store
