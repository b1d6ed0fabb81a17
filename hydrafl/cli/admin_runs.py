"""`hydrafl admin run ...`: queue runs, follow them (status, list, logs), stop, resume, export and delete them,
on the coordinator's database or through its admin service (`admin_client`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from hydrafl.cli.admin_client import Connect, RunsOption, administered
from hydrafl.cli.common import DbOption, console, fail, fail_one_line, open_store, warn
from hydrafl.cli.export import describe
from hydrafl.rounds import megabytes
from hydrafl.trust import trust_lines

if TYPE_CHECKING:
    from hydrafl.server.retention import Retention

run_admin = typer.Typer(help="Create runs, follow, stop and export them.", no_args_is_help=True)


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
    app: Annotated[
        Path | None,
        typer.Option(
            "--app",
            help="Run a Flower app project (its folder, as `flwr run DIR`) or a .fab `flwr build` made: "
            "the coordinator runs its ServerApp and ships it to the sites that allow its digest.",
        ),
    ] = None,
    run_config: Annotated[
        list[str] | None,
        typer.Option(
            "--run-config",
            help="With --server-app or --app: key=value (TOML values, as `flwr run`), repeatable.",
        ),
    ] = None,
) -> None:
    """Queue a run; the coordinator starts it when enough sites are connected.

    Every run key is a flag: --strategy diloco --rounds 20 --sites 3 --outer-lr 0.5 (`hydrafl keys` lists the
    run-wide keys, `hydrafl strategies` the knobs). The strategies are loaded to check the run (a few seconds).
    With --server-app the coordinator runs that Flower ServerApp on its grid with the --run-config values as its
    context.run_config, as `flwr run` does; sites run the matching ClientApp (`hydrafl site --app`). With --app
    the project's components and `[tool.flwr.app.config]` defaults (overridden by --run-config) make the run,
    and sites that allow the bundle's SHA-256 (`hydrafl site --allow-app`) run its ClientApp.
    """
    if server_app is not None or app is not None:
        if ctx.args or config or (server_app is not None and app is not None):
            fail_one_line(
                "a --server-app or --app run takes its keys as --run-config key=value, not as flags or "
                "--config (and takes one of --server-app and --app)",
                2,
            )
        if app is not None:
            _create_bundle_run(app, run_config or [], connect)
        else:
            _create_server_app_run(server_app or "", run_config or [], connect)
        return
    if run_config:
        fail_one_line(
            "--run-config goes with --server-app or --app; hydrafl's own runs take their keys as "
            "--key value",
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
    what = "cohort statistics" if run.job == "stats" else f"{run.strategy}, {run.rounds} rounds"
    console.print(f"created run {created['id']} ({what}, task {run.task})")
    print(created["id"])


def _create_bundle_run(path: Path, entries: list[str], connect: Connect) -> None:
    """Queue a run of a Flower app project or .fab: its ServerApp, its config defaults under --run-config."""
    from hydrafl.app_bundle import BundleError, load_bundle
    from hydrafl.server.stock_apps import ServerAppError, parse_run_config

    try:
        bundle = load_bundle(path)
        values = {**bundle.config, **parse_run_config(entries)}
    except (BundleError, ServerAppError) as error:
        fail_one_line(str(error), 2)
    run_id = connect(create=True).create_run(
        values, server_app=bundle.server_app, app_bundle=bundle.data
    )["id"]
    console.print(
        escape(
            f"created run {run_id} (app bundle sha256:{bundle.digest}, ServerApp {bundle.server_app}, "
            f"run config {values}); sites run it with `hydrafl site --allow-app {bundle.digest}`"
        ),
        soft_wrap=True,
    )
    print(run_id)


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


BlobsOption = Annotated[
    Path | None, typer.Option("--blobs", help="Blob folder (default: $HYDRAFL_HOME/blobs).")
]


def coordinator_retention(
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
        report = coordinator_retention(db, blobs, runs).delete_run(run_id)
    except RunRunning as error:
        fail_one_line(str(error), 1)
    except ValueError as error:
        fail_one_line(str(error), 2)
    print(f"deleted run {run_id}: {report.describe()}")
