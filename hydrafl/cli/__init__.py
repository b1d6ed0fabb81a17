"""The `hydrafl` command: one module per command group, each importing what it runs only when it runs it.

`hydrafl --help` and the admin commands therefore start without torch, Flower or matplotlib. The package
`hydrafl` itself, imported first, sets Flower's telemetry and Hugging Face's offline mode for every command.
"""

from __future__ import annotations

import sys
from importlib.metadata import version
from typing import Annotated

import typer

from hydrafl.cli import admin, server, simulate, site, stability
from hydrafl.malloc_tuning import keep_freed_memory

app = typer.Typer(
    help="hydrafl: federated fine-tuning for hospital consortia.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _show_version(show: bool) -> None:
    if show:
        typer.echo(f"hydrafl {version('hydrafl')}")
        raise typer.Exit()


@app.callback()
def _options(
    _version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_show_version,
            is_eager=True,
            help="Print hydrafl's version and exit.",
        ),
    ] = False,
) -> None:
    """hydrafl: federated fine-tuning for hospital consortia."""


app.command("simulate", context_settings=simulate.FLAG_SETTINGS, cls=simulate.KeysInHelp)(
    simulate.simulate
)
app.command("keys")(simulate.keys)
app.command("strategies")(simulate.strategies)
app.command("stability")(stability.stability)
app.add_typer(admin.admin_app, name="admin")
app.command("server")(server.server)
app.command("site")(site.site)


LONG_LIVED = ("site", "server")
"""Commands whose process lives for many rounds, and keeps the memory a round frees for the next one."""


def main() -> None:
    """The `hydrafl` command. A site or coordinator process takes `keep_freed_memory` here, before any thread
    starts, and never in-process (a test or an embedding program keeps its own allocator)."""
    command = next((arg for arg in sys.argv[1:] if not arg.startswith("-")), "")
    if command in LONG_LIVED:
        keep_freed_memory()
    app()
