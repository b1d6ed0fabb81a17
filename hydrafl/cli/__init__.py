"""The `hydrafl` command: one module per command group, each importing what it runs only when it runs it.

`hydrafl --help` and the admin commands therefore start without torch, Flower or matplotlib. The package
`hydrafl` itself, imported first, sets Flower's telemetry and Hugging Face's offline mode for every command.
"""

from __future__ import annotations

import typer

from hydrafl.cli import admin, server, simulate, site, stability

app = typer.Typer(
    help="hydrafl: federated fine-tuning for hospital consortia.", no_args_is_help=True, pretty_exceptions_show_locals=False
)
app.command("simulate", context_settings=simulate.FLAG_SETTINGS)(simulate.simulate)
app.command("keys")(simulate.keys)
app.command("strategies")(simulate.strategies)
app.command("stability")(stability.stability)
app.add_typer(admin.admin_app, name="admin")
app.command("server")(server.server)
app.command("site")(site.site)


def main() -> None:
    app()
