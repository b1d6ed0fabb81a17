"""`hydrafl admin`: enrol and revoke sites, queue runs and follow them, straight on the coordinator's database.

Only `run create` loads the run configuration (and with it torch); the rest needs SQLAlchemy and nothing else.
"""

from __future__ import annotations

import base64
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from hydrafl.cli.common import DbOption, console, fail, fail_one_line, open_store, warn
from hydrafl.cli.db import db_admin
from hydrafl.cli.export import run_export
from hydrafl.rounds import megabytes
from hydrafl.trust import trust_lines, trust_summary

if TYPE_CHECKING:
    from hydrafl.server.retention import Retention
    from hydrafl.server.tables import AuditEvent

VERBOSE = "hydrafl.admin.verbose"
"""`ctx.meta` key: `hydrafl admin -v` was given."""


class OneLineErrors(TyperGroup):
    """An admin command that fails unexpectedly (a database gone, a disk full) says so in one line, exit 1; the
    traceback comes with `hydrafl admin -v`. Expected refusals are each command's own one-line exits."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except Exception as error:  # one line for anything a command did not expect
            if ctx.meta.get(VERBOSE):
                raise
            fail_one_line(
                f"{type(error).__name__}: {error} (`hydrafl admin -v ...` shows the traceback)", 1
            )


admin_app = typer.Typer(
    help="Administer a coordinator's database: sites (and runs).",
    no_args_is_help=True,
    cls=OneLineErrors,
)


@admin_app.callback()
def _admin_options(
    ctx: typer.Context,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Show the traceback of an unexpected error.")
    ] = False,
) -> None:
    """Administer a coordinator's database: sites (and runs)."""
    ctx.meta[VERBOSE] = verbose


site_admin = typer.Typer(help="Enrol, list and revoke hospital sites.", no_args_is_help=True)
admin_app.add_typer(site_admin, name="site")
admin_app.add_typer(db_admin, name="db")


ConsortiumKeyOption = Annotated[
    Path | None,
    typer.Option(
        help="The consortium's signing key (`hydrafl admin consortium create`): issue the site's secure-aggregation "
        "identity with it."
    ),
]
IdentityOutOption = Annotated[
    Path | None,
    typer.Option(
        help="Where the site's identity file goes (default NAME.secagg-identity.json); "
        "hand it to the site with its token."
    ),
]


@site_admin.command("add")
def site_add(
    name: Annotated[str, typer.Argument(help="Site name, e.g. st-marys.")],
    consortium_key: ConsortiumKeyOption = None,
    identity_out: IdentityOutOption = None,
    db: DbOption = None,
) -> None:
    """Enrol a site and print its one-time token (only a hash is stored: copy it now); with --consortium-key,
    also write its secure-aggregation identity."""
    consortium = _read_consortium_key(consortium_key) if consortium_key else None
    try:
        site, token = open_store(db, create=True).add_site(name)
    except ValueError as error:
        fail(str(error), 2)
    console.print(f"enrolled [bold]{site.name}[/] as node {site.node_id}; its token (shown once):")
    print(token)
    if consortium is not None:
        _write_identity(
            consortium, site.node_id, identity_out or Path(f"{name}.secagg-identity.json")
        )


@site_admin.command("certify")
def site_certify(
    name: Annotated[str, typer.Argument(help="Site name.")],
    consortium_key: Annotated[
        Path, typer.Option(help="The consortium's signing key (`hydrafl admin consortium create`).")
    ],
    identity_out: IdentityOutOption = None,
    db: DbOption = None,
) -> None:
    """Issue an enrolled site a new secure-aggregation identity (its old one stays valid: the consortium key,
    not a list, vouches for both)."""
    consortium = _read_consortium_key(consortium_key)
    site = next(
        (site for site in open_store(db).sites() if site.name == name and not site.revoked), None
    )
    if site is None:
        fail(
            f"no active site named {name!r}; `hydrafl admin site list` shows the enrolled sites", 2
        )
    _write_identity(consortium, site.node_id, identity_out or Path(f"{name}.secagg-identity.json"))


consortium_admin = typer.Typer(
    help="The consortium's signing key, which certifies sites for secure aggregation.",
    no_args_is_help=True,
)
admin_app.add_typer(consortium_admin, name="consortium")


@consortium_admin.command("create")
def consortium_create(
    path: Annotated[
        Path, typer.Argument(help="Where the key goes; keep it off the coordinator's machine.")
    ],
) -> None:
    """Create the consortium's signing key: the coordinator never holds it, so it cannot certify a key of its own."""
    from hydrafl.secagg.identity import new_signing_key, verifying_key

    key = new_signing_key()
    try:
        with open(
            path, "x", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o600)
        ) as file:
            file.write(base64.b64encode(key).decode() + "\n")
    except OSError as error:
        fail(escape(f"cannot create {path}: {error.strerror or error}"), 2)
    console.print(
        f"wrote the consortium key to {escape(str(path))}; its public half (each identity file carries it):"
    )
    print(base64.b64encode(verifying_key(key)).decode())


def _read_consortium_key(path: Path) -> bytes:
    try:
        key = base64.b64decode(path.read_text(encoding="utf-8").strip(), validate=True)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        fail(escape(f"cannot read --consortium-key {path}: {error}"), 2)
    if len(key) != 32:
        fail(
            escape(
                f"--consortium-key {path} is not a consortium key (`hydrafl admin consortium create` makes one)"
            ),
            2,
        )
    return key


def _write_identity(consortium: bytes, node_id: int, path: Path) -> None:
    """A new certified identity for `node_id`, readable by its owner only: it holds the site's signing key."""
    from hydrafl.secagg import SiteIdentity

    try:
        with open(
            path, "x", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o600)
        ) as file:
            file.write(SiteIdentity.issue(consortium, node_id).to_json() + "\n")
    except OSError as error:
        fail(escape(f"cannot create {path}: {error.strerror or error}"), 2)
    console.print(
        f"wrote its secure-aggregation identity to {escape(str(path))}: hand it to the site with its "
        "token (`hydrafl site --secagg-identity FILE`)"
    )


@site_admin.command("list")
def site_list(db: DbOption = None) -> None:
    """List enrolled sites."""
    table = Table("site", "node id", "status", "enrolled")
    for site in open_store(db).sites():
        table.add_row(
            site.name,
            str(site.node_id),
            "revoked" if site.revoked else "active",
            f"{site.created_at:%Y-%m-%d %H:%M}",
        )
    Console().print(table)


@site_admin.command("revoke")
def site_revoke(
    name: Annotated[str, typer.Argument(help="Site name.")], db: DbOption = None
) -> None:
    """Revoke a site: its token is refused from now on."""
    try:
        open_store(db).revoke_site(name)
    except ValueError as error:
        fail(str(error), 2)
    console.print(f"revoked [bold]{name}[/]")


run_admin = typer.Typer(help="Create runs and follow them.", no_args_is_help=True)
admin_app.add_typer(run_admin, name="run")


@run_admin.command(
    "create", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
def run_create(
    ctx: typer.Context,
    config: Annotated[
        Path | None, typer.Option(help="TOML file of run keys (task, strategy, rounds, knobs...).")
    ] = None,
    server_app: Annotated[
        str | None,
        typer.Option(
            "--server-app", help="Run a stock Flower ServerApp instead, as module:attribute."
        ),
    ] = None,
    run_config: Annotated[
        list[str] | None,
        typer.Option(
            "--run-config",
            help="With --server-app: key=value (TOML values, as `flwr run`), repeatable.",
        ),
    ] = None,
    db: DbOption = None,
) -> None:
    """Queue a run; the coordinator starts it when enough sites are connected.

    Every run key is a flag: --strategy diloco --rounds 20 --sites 3 --outer-lr 0.5 (`hydrafl keys` lists the
    run-wide keys, `hydrafl strategies` the knobs). The strategies are loaded to check the run (a few seconds).
    With --server-app the coordinator runs that Flower ServerApp on its grid with the --run-config values as its
    context.run_config, as `flwr run` does; sites run the matching ClientApp (`hydrafl site --app`).
    """
    if server_app is not None:
        if ctx.args or config:
            fail_one_line(
                "a --server-app run takes its keys as --run-config key=value, not as flags or --config",
                2,
            )
        _create_server_app_run(server_app, run_config or [], db)
        return
    if run_config:
        fail_one_line(
            "--run-config goes with --server-app; hydrafl's own runs take their keys as --key value",
            2,
        )
    from hydrafl.cli.flags import parse_flags
    from hydrafl.config import RunConfig
    from hydrafl.config_keys import key_type
    from hydrafl.configfile import load_toml
    from hydrafl.validation import ConfigError

    try:
        values = {**(load_toml(config) if config else {}), **parse_flags(ctx.args, key_type)}
        run = RunConfig.from_flower(values, source=str(config) if config else "options")
    except ConfigError as error:
        fail(str(error), 2)
    stored = {k: v for k, v in run.to_flower().items() if k not in ("run-dir", "resume")}
    created = open_store(db, create=True).create_run(stored)
    what = "cohort statistics" if run.job == "stats" else f"{run.strategy}, {run.rounds} rounds"
    console.print(f"created run {created.id} ({what}, task {run.task})")
    print(created.id)


def _create_server_app_run(reference: str, entries: list[str], db: str | None) -> None:
    """Queue a stock ServerApp run. The app is loaded here to refuse a wrong reference now; a module that is not
    on this machine's path may be on the coordinator's, which then checks it when it starts the run."""
    from hydrafl.server.stock_apps import (
        ServerAppError,
        ServerAppNotFound,
        load_server_app,
        parse_run_config,
    )

    try:
        values = parse_run_config(entries)
        load_server_app(reference)
    except ServerAppNotFound as error:
        warn(
            f"{error} here; queued anyway: the coordinator loads it when it starts the run (or fails the run)"
        )
    except ServerAppError as error:
        fail_one_line(str(error), 2)
    run = open_store(db, create=True).create_run(values, server_app=reference)
    console.print(
        escape(f"created run {run.id} (ServerApp {reference}, run config {values})"), soft_wrap=True
    )
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
    summary: dict[str, Any] = {
        "run": run.id,
        "status": run.status,
        "rounds_done": run.rounds_done,
        "rounds": run.total_rounds,
        "strategy": None if run.server_app else run.config.get("strategy"),
        "server_app": run.server_app,
        "run_config": run.config if run.server_app else None,
        "detail": run.detail,
        "history": run.history,
        "declines": declines,
        "trust": trust_summary(run.history, {} if run.server_app else run.config),
    }
    if as_json:
        print(json.dumps(summary))
        return
    what = f"ServerApp {run.server_app}" if run.server_app else summary["strategy"]
    Console().print(
        escape(f"run {run.id}: {run.status}, {run.rounds_done}/{summary['rounds']} rounds ({what})")
    )
    if run.status == "failed" and run.detail:
        Console().print(escape(f"failed: {run.detail}"), soft_wrap=True)
    if run.history:
        table = Table("round", "loss", "accuracy", "sites ok", "MB up", "MB down", "seconds")
        for record in run.history:
            table.add_row(
                str(record["round"]),
                f"{record['loss'] or 0:.4f}",
                f"{record['accuracy'] or 0:.4f}",
                str(record["sites_ok"]),
                megabytes(record.get("bytes_up")),
                megabytes(record.get("bytes_down")),
                f"{record['seconds']:.2f}",
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
        stock = run.server_app is not None
        strategy, task = (
            (run.server_app, "-") if stock else (run.config.get("strategy"), run.config.get("task"))
        )
        table.add_row(
            str(run.id),
            escape(str(strategy)),
            str(task),
            run.status,
            f"{run.rounds_done}/{run.total_rounds}",
            f"{run.created_at:%Y-%m-%d %H:%M}",
        )
    Console().print(table)


BlobsOption = Annotated[
    Path | None, typer.Option("--blobs", help="Blob folder (default: $HYDRAFL_HOME/blobs).")
]
RunsOption = Annotated[
    Path | None, typer.Option("--runs", help="Run folders (default: $HYDRAFL_HOME/runs).")
]


def _retention(
    db: str | None, blobs: Path | None, runs: Path | None, **options: object
) -> Retention:
    """The coordinator home's Retention, as a process beside the coordinator (`server.retention`)."""
    from hydrafl.server.blobs import BlobStore
    from hydrafl.server.paths import data_dir, default_blob_dir
    from hydrafl.server.retention import Retention

    store = open_store(db)
    return Retention.beside(
        store, BlobStore(blobs or default_blob_dir()), runs or data_dir() / "runs", **options
    )


@admin_app.command("gc")
def gc(
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say what would be deleted; delete nothing.")
    ] = False,
    keep_checkpoints: Annotated[
        int, typer.Option(min=1, help="Checkpoints kept per run folder.")
    ] = 2,
    db: DbOption = None,
    blobs: BlobsOption = None,
    runs: RunsOption = None,
) -> None:
    """Delete what no run needs any more: ended runs' messages, replies and chunks, older checkpoints, orphan
    chunks. Runs keep their history, audit events and newest checkpoints. Safe beside a running coordinator."""
    retention = _retention(db, blobs, runs, keep_checkpoints=keep_checkpoints, dry_run=dry_run)
    report = retention.collect()
    if retention.grace_s:
        warn(
            f"a coordinator is serving: unreferenced chunks younger than {retention.grace_s:g} s are kept"
        )
    print(("would delete: " if dry_run else "deleted: ") + report.describe())


@run_admin.command("delete")
def run_delete(
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    db: DbOption = None,
    blobs: BlobsOption = None,
    runs: RunsOption = None,
) -> None:
    """Delete a run that is not running: its folder, messages, replies, chunks, audit events and row (one
    `run-deleted` audit event records it)."""
    from hydrafl.server.retention import RunRunning

    try:
        report = _retention(db, blobs, runs).delete_run(run_id)
    except RunRunning as error:
        fail_one_line(str(error), 1)
    except ValueError as error:
        fail_one_line(str(error), 2)
    print(f"deleted run {run_id}: {report.describe()}")


run_admin.command("export")(run_export)
