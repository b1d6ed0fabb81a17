"""`hydrafl admin`: enrol and revoke sites, queue runs and follow them, straight on the coordinator's database.

Only `run create` loads the run configuration (and with it torch); the rest needs SQLAlchemy and nothing else.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hydrafl.cli.common import DbOption, console, fail, open_store
from hydrafl.trust import trust_lines, trust_summary

if TYPE_CHECKING:
    from hydrafl.server.store import AuditEvent

admin_app = typer.Typer(help="Administer a coordinator's database: sites (and runs).", no_args_is_help=True)
site_admin = typer.Typer(help="Enrol, list and revoke hospital sites.", no_args_is_help=True)
admin_app.add_typer(site_admin, name="site")


@site_admin.command("add")
def site_add(name: Annotated[str, typer.Argument(help="Site name, e.g. st-marys.")], db: DbOption = None) -> None:
    """Enrol a site and print its one-time token (only a hash is stored: copy it now)."""
    try:
        site, token = open_store(db).add_site(name)
    except ValueError as error:
        fail(str(error), 2)
    console.print(f"enrolled [bold]{site.name}[/] as node {site.node_id}; its token (shown once):")
    print(token)


@site_admin.command("list")
def site_list(db: DbOption = None) -> None:
    """List enrolled sites."""
    table = Table("site", "node id", "status", "enrolled")
    for site in open_store(db).sites():
        table.add_row(site.name, str(site.node_id), "revoked" if site.revoked else "active", f"{site.created_at:%Y-%m-%d %H:%M}")
    Console().print(table)


@site_admin.command("revoke")
def site_revoke(name: Annotated[str, typer.Argument(help="Site name.")], db: DbOption = None) -> None:
    """Revoke a site: its token is refused from now on."""
    try:
        open_store(db).revoke_site(name)
    except ValueError as error:
        fail(str(error), 2)
    console.print(f"revoked [bold]{name}[/]")


run_admin = typer.Typer(help="Create runs and follow them.", no_args_is_help=True)
admin_app.add_typer(run_admin, name="run")


@run_admin.command("create", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def run_create(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="TOML file of run keys (task, strategy, rounds, knobs...).")] = None,
    db: DbOption = None,
) -> None:
    """Queue a run; the coordinator starts it when enough sites are connected.

    Every run key is a flag: --strategy diloco --rounds 20 --sites 3 --outer-lr 0.5 (`hydrafl keys` lists the
    run-wide keys, `hydrafl strategies` the knobs). The strategies are loaded to check the run (a few seconds).
    """
    from hydrafl.cli.flags import parse_flags
    from hydrafl.config import RunConfig
    from hydrafl.config_keys import key_type
    from hydrafl.configfile import load_toml
    from hydrafl.validation import ConfigError

    try:
        values = {**(load_toml(config) if config else {}), **parse_flags(ctx.args, key_type)}
        run_config = RunConfig.from_flower(values, source=str(config) if config else "options")
    except ConfigError as error:
        fail(str(error), 2)
    stored = {k: v for k, v in run_config.to_flower().items() if k not in ("run-dir", "resume")}
    run = open_store(db).create_run(stored)
    console.print(f"created run {run.id} ({run_config.strategy}, {run_config.rounds} rounds, task {run_config.task})")
    print(run.id)


@run_admin.command("status")
def run_status(
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    db: DbOption = None,
) -> None:
    """A run's state, rounds done, per-round metrics and the sites that declined or failed its messages."""
    store = open_store(db)
    try:
        run = store.run(run_id)
    except ValueError as error:
        fail(str(error), 2)
    declines = [_decline(event) for event in store.run_events(run_id, DECLINE_KINDS)]
    summary = {
        "run": run.id,
        "status": run.status,
        "rounds_done": run.rounds_done,
        "rounds": run.config.get("rounds"),
        "strategy": run.config.get("strategy"),
        "detail": run.detail,
        "history": run.history,
        "declines": declines,
        "trust": trust_summary(run.history, run.config),
    }
    if as_json:
        print(json.dumps(summary))
        return
    Console().print(f"run {run.id}: {run.status}, {run.rounds_done}/{summary['rounds']} rounds ({summary['strategy']})")
    table = Table("round", "loss", "accuracy", "sites ok", "bytes up", "seconds")
    for record in run.history:
        table.add_row(
            str(record["round"]), f"{record['loss'] or 0:.4f}", f"{record['accuracy'] or 0:.4f}",
            str(record["sites_ok"]), str(record["bytes_up"]), f"{record['seconds']:.2f}",
        )
    Console().print(table)
    for line in trust_lines(summary["trust"]):
        Console().print(escape(line))
    if declines:
        _print_declines(declines)


DECLINE_KINDS = ("site-declined",)
SHOWN_DECLINES = 20
ROUND_PREFIX = re.compile(r"round (\d+)\s*(.*)", re.DOTALL)


def _decline(event: AuditEvent) -> dict:
    """A site-declined audit event as site, round (when its detail starts with "round N") and reason."""
    parsed = ROUND_PREFIX.fullmatch(event.detail)
    return {
        "site": event.site_name,
        "round": int(parsed.group(1)) if parsed else None,
        "reason": parsed.group(2) if parsed else event.detail,
        "at": f"{event.at:%Y-%m-%d %H:%M:%S}",
    }


def _print_declines(declines: list[dict]) -> None:
    shown = declines[-SHOWN_DECLINES:]
    earlier = f", the last {len(shown)} of {len(declines)}" if len(declines) > len(shown) else ""
    table = Table("site", "round", "reason")
    for decline in shown:
        round_text = "" if decline["round"] is None else str(decline["round"])
        table.add_row(escape(decline["site"]), round_text, escape(decline["reason"]))
    Console().print(f"sites that declined or failed{earlier}:")
    Console().print(table)


@run_admin.command("list")
def run_list(db: DbOption = None) -> None:
    """All runs."""
    table = Table("run", "strategy", "task", "status", "rounds", "created")
    for run in open_store(db).runs():
        table.add_row(
            str(run.id), str(run.config.get("strategy")), str(run.config.get("task")), run.status,
            f"{run.rounds_done}/{run.config.get('rounds')}", f"{run.created_at:%Y-%m-%d %H:%M}",
        )
    Console().print(table)
