"""`hydrafl admin`: enrol and revoke sites, queue runs, follow them, stop them and export their model, on the
coordinator's database (`--db`) or from another machine through its admin service (`--coordinator HOST:PORT
--admin-token-file F`); both ways call one interface (`admin_client.AdminApi`).

Only `run create` and `run export` load the run configuration (and with it torch); the rest needs SQLAlchemy or
gRPC and nothing else.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import click
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

from hydrafl.cli.admin_client import Connect, RunsOption, administered
from hydrafl.cli.admin_runs import BlobsOption, coordinator_retention, run_admin
from hydrafl.cli.common import DbOption, console, fail, fail_one_line, open_store, warn
from hydrafl.cli.db import db_admin

if TYPE_CHECKING:
    pass

VERBOSE = "hydrafl.admin.verbose"
"""`ctx.meta` key: `hydrafl admin -v` was given."""


class OneLineErrors(TyperGroup):
    """An admin command that fails unexpectedly (a database gone, a disk full) says so in one line, exit 1; the
    traceback comes with `hydrafl admin -v`. Expected refusals are each command's own one-line exits; a
    coordinator that cannot be reached or refuses the admin token is one line, exit 1."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except ConnectionError as error:  # a coordinator unreachable, or refusing the admin token
            fail_one_line(str(error), 1)
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
admin_app.add_typer(run_admin, name="run")


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
    retention = coordinator_retention(
        db, blobs, runs, keep_checkpoints=keep_checkpoints, dry_run=dry_run
    )
    report = retention.collect()
    if retention.grace_s:
        warn(
            f"a coordinator is serving: unreferenced chunks younger than {retention.grace_s:g} s are kept"
        )
    print(("would delete: " if dry_run else "deleted: ") + report.describe())
