"""`hydrafl admin`: enrol and revoke sites, queue runs, follow them, stop them and export their model, on the
coordinator's database (`--db`) or from another machine through its admin service (`--coordinator HOST:PORT
--admin-token-file F`); both ways call one interface (`admin_client.AdminApi`).

Only `run create` and `run export` load the run configuration (and with it torch); the rest needs SQLAlchemy or
gRPC and nothing else.
"""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from hydrafl.cli.admin_client import Connect, RunsOption, administered
from hydrafl.cli.common import DbOption, console, fail, fail_one_line, open_store, warn
from hydrafl.cli.db import db_admin
from hydrafl.cli.export import describe
from hydrafl.rounds import megabytes
from hydrafl.trust import trust_lines

if TYPE_CHECKING:
    from hydrafl.server.retention import Retention

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
    help="Administer a coordinator, on its database or from another machine: sites, runs, admin tokens.",
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
    """Administer a coordinator, on its database (--db) or from another machine (--coordinator HOST:PORT
    --admin-token-file F): sites, runs, admin tokens."""
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
@administered()
def site_add(
    connect: Connect,
    name: Annotated[str, typer.Argument(help="Site name, e.g. st-marys.")],
    consortium_key: ConsortiumKeyOption = None,
    identity_out: IdentityOutOption = None,
) -> None:
    """Enrol a site and print its one-time token (only a hash is stored: copy it now); with --consortium-key,
    also write its secure-aggregation identity."""
    consortium = _read_consortium_key(consortium_key) if consortium_key else None
    api = connect(create=True)
    try:
        site = api.add_site(name)
    except ValueError as error:
        fail_one_line(str(error), 2)
    console.print(
        f"enrolled [bold]{escape(site['name'])}[/] as node {site['node_id']}; its token (shown once):"
    )
    print(site["token"])
    if consortium is not None:
        _write_identity(
            consortium, site["node_id"], identity_out or Path(f"{name}.secagg-identity.json")
        )


@site_admin.command("certify")
@administered()
def site_certify(
    connect: Connect,
    name: Annotated[str, typer.Argument(help="Site name.")],
    consortium_key: Annotated[
        Path, typer.Option(help="The consortium's signing key (`hydrafl admin consortium create`).")
    ],
    identity_out: IdentityOutOption = None,
) -> None:
    """Issue an enrolled site a new secure-aggregation identity (its old one stays valid: the consortium key,
    not a list, vouches for both)."""
    consortium = _read_consortium_key(consortium_key)
    sites = connect().sites()
    site = next((site for site in sites if site["name"] == name and not site["revoked"]), None)
    if site is None:
        fail(
            f"no active site named {name!r}; `hydrafl admin site list` shows the enrolled sites", 2
        )
    _write_identity(
        consortium, site["node_id"], identity_out or Path(f"{name}.secagg-identity.json")
    )


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
@administered()
def site_list(
    connect: Connect,
) -> None:
    """List enrolled sites."""
    table = Table("site", "node id", "status", "enrolled")
    for site in connect().sites():
        table.add_row(
            escape(site["name"]),
            str(site["node_id"]),
            "revoked" if site["revoked"] else "active",
            site["created_at"],
        )
    Console().print(table)


@site_admin.command("revoke")
@administered()
def site_revoke(
    connect: Connect,
    name: Annotated[str, typer.Argument(help="Site name.")],
) -> None:
    """Revoke a site: its token is refused from now on."""
    try:
        connect().revoke_site(name)
    except ValueError as error:
        fail_one_line(str(error), 2)
    console.print(f"revoked [bold]{escape(name)}[/]")


run_admin = typer.Typer(help="Create runs and follow them.", no_args_is_help=True)
admin_app.add_typer(run_admin, name="run")


@run_admin.command(
    "create", context_settings={"allow_extra_args": True, "ignore_unknown_options": True}
)
@administered()
def run_create(
    connect: Connect,
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
        _create_server_app_run(server_app, run_config or [], connect)
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
    created = connect(create=True).create_run(stored)
    console.print(
        f"created run {created['id']} ({run.strategy}, {run.rounds} rounds, task {run.task})"
    )
    print(created["id"])


def _create_server_app_run(reference: str, entries: list[str], connect: Connect) -> None:
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
    run_id = connect(create=True).create_run(values, server_app=reference)["id"]
    console.print(
        escape(f"created run {run_id} (ServerApp {reference}, run config {values})"), soft_wrap=True
    )
    print(run_id)


@run_admin.command("status")
@administered()
def run_status(
    connect: Connect,
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
) -> None:
    """A run's state, rounds done, per-round metrics and the sites that declined or failed its messages."""
    try:
        summary = connect().run_status(run_id)
    except ValueError as error:
        fail_one_line(str(error), 2)
    if as_json:
        print(json.dumps(summary))
        return
    what = f"ServerApp {summary['server_app']}" if summary["server_app"] else summary["strategy"]
    Console().print(
        escape(
            f"run {run_id}: {summary['status']}, {summary['rounds_done']}/{summary['rounds']} rounds "
            f"({what})"
        )
    )
    if summary["status"] in ("failed", "stopped") and summary["detail"]:
        Console().print(escape(f"{summary['status']}: {summary['detail']}"), soft_wrap=True)
    if summary["history"]:
        table = Table("round", "loss", "accuracy", "sites ok", "MB up", "MB down", "seconds")
        for record in summary["history"]:
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
    if summary["declines"]:
        _print_declines(summary["declines"])


SHOWN_DECLINES = 20


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
@administered()
def run_list(
    connect: Connect,
) -> None:
    """All runs."""
    table = Table("run", "strategy", "task", "status", "rounds", "created")
    for run in connect().runs():
        table.add_row(
            str(run["id"]),
            escape(str(run["strategy"])),
            str(run["task"]),
            run["status"],
            f"{run['rounds_done']}/{run['rounds']}",
            run["created_at"],
        )
    Console().print(table)


FOLLOW_POLL_S = 0.5
ENDED = ("finished", "failed", "stopped")


@run_admin.command("logs")
@administered(runs=True)
def run_logs(
    connect: Connect,
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing new lines until the run ends."),
    ] = False,
) -> None:
    """The coordinator's log lines of a run (as `flwr log`); with --follow, until the run ends."""
    api = connect()
    offset = 0
    while True:
        try:
            read = api.run_logs(run_id, offset)
        except ValueError as error:
            fail_one_line(str(error), 2)
        for line in read["lines"]:
            print(line, flush=True)
        moved, offset = read["offset"] != offset, read["offset"]
        if not follow or (read["status"] in ENDED and not moved):
            return
        if not moved:
            time.sleep(FOLLOW_POLL_S)


@run_admin.command("stop")
@administered()
def run_stop(
    connect: Connect,
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    now: Annotated[
        bool,
        typer.Option(
            "--now", help="Stop at once, dropping the round in progress (default: at its end)."
        ),
    ] = False,
) -> None:
    """Stop a run (as `flwr stop`) at the end of its current round, its checkpoint written; `run resume`
    continues it from there. A stock ServerApp's run stops before its next round and starts again on resume."""
    try:
        status = connect().stop_run(run_id, now)["status"]
    except ValueError as error:
        fail_one_line(str(error), 2)
    when = "at once" if now else "at the end of its current round"
    console.print(
        f"run {run_id} stopped"
        if status == "stopped"
        else f"run {run_id} stops {when}; `hydrafl admin run status {run_id}` says when it did"
    )


@run_admin.command("resume")
@administered()
def run_resume(
    connect: Connect,
    run_id: Annotated[int, typer.Argument(help="Run id.")],
) -> None:
    """Queue a stopped run again: the coordinator continues it from its last checkpoint, as after a crash."""
    try:
        connect().resume_run(run_id)
    except ValueError as error:
        fail_one_line(str(error), 2)
    console.print(f"run {run_id} queued again; it continues from its last checkpoint")


@run_admin.command("export")
@administered(runs=True)
def run_export(
    connect: Connect,
    run_id: Annotated[int, typer.Argument(help="Run id.")],
    out: Annotated[Path, typer.Argument(help="Folder to write the model to.")],
    data: Annotated[
        str,
        typer.Option(
            help="A sample of the sites' data, for a run whose sites read their own files (the model's "
            "classes and vocabulary come from it); with --coordinator, a path on the coordinator."
        ),
    ] = "",
) -> None:
    """Write run ID's final model to DIR as a Hugging Face `save_pretrained` folder, a PEFT adapter beside its
    base model (LoRA runs), or safetensors with its architecture (hydrafl's small models)."""
    api = connect()
    try:
        kind = api.export(run_id, out, data)
    except (FileNotFoundError, ValueError) as error:  # ExportError is a ValueError
        fail_one_line(f"run {run_id}: {error}", 2)
    print(describe(kind, out))


token_admin = typer.Typer(
    help="Administrators' tokens for `--coordinator` (created on the coordinator's database only).",
    no_args_is_help=True,
)
admin_app.add_typer(token_admin, name="token")


@token_admin.command("create")
def token_create(
    name: Annotated[str, typer.Argument(help="Who holds it, e.g. alice.")],
    out: Annotated[
        Path, typer.Option(help="Where the token goes (readable by you alone); hand it to NAME.")
    ],
    db: DbOption = None,
) -> None:
    """Create an administrator's token for `hydrafl admin ... --coordinator` (only its hash is stored)."""
    try:
        token = open_store(db, create=True).add_admin(name)
    except ValueError as error:
        fail_one_line(str(error), 2)
    try:
        with open(
            out, "x", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o600)
        ) as file:
            file.write(token + "\n")
    except OSError as error:
        open_store(db).revoke_admin(name)
        fail_one_line(f"cannot create {out}: {error.strerror or error}; the token was revoked", 2)
    console.print(escape(f"wrote admin {name}'s token to {out}: pass it as --admin-token-file"))


@token_admin.command("list")
def token_list(db: DbOption = None) -> None:
    """Administrators' tokens: who holds each, and whether it is revoked."""
    table = Table("admin", "status", "created")
    for admin in open_store(db).admins():
        table.add_row(
            escape(admin.name),
            "revoked" if admin.revoked else "active",
            f"{admin.created_at:%Y-%m-%d %H:%M}",
        )
    Console().print(table)


@token_admin.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="Who holds it.")], db: DbOption = None
) -> None:
    """Revoke an administrator's token: the coordinator refuses it from now on."""
    try:
        open_store(db).revoke_admin(name)
    except ValueError as error:
        fail_one_line(str(error), 2)
    console.print(escape(f"revoked admin {name}'s token"))


BlobsOption = Annotated[
    Path | None, typer.Option("--blobs", help="Blob folder (default: $HYDRAFL_HOME/blobs).")
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
