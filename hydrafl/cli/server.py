"""`hydrafl server`: run the coordinator until Ctrl-C, SIGTERM or the loss of its database lease."""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from hydrafl.cli.common import DbOption, console, fail_one_line, setup_logging, warn

if TYPE_CHECKING:
    from hydrafl.server.config import CoordinatorConfig
    from hydrafl.server.dashboard import Dashboard, DashboardConfig

log = logging.getLogger(__name__)

CLI_ONLY_OPTIONS = ("config", "verbose", "dashboard", "dashboard_token")
"""`server`'s options that are not CoordinatorConfig's (its TOML keys)."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, told apart from Ctrl-C in the line that says why the coordinator stopped."""


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (docker stop, systemd) stops the coordinator as Ctrl-C does: it releases its database lease."""
    raise Terminated


def server(
    config: Annotated[
        Path | None, typer.Option(help="TOML file with these options' names as keys.")
    ] = None,
    listen: Annotated[
        str | None, typer.Option(help="HOST:PORT to serve on (default 127.0.0.1:9091).")
    ] = None,
    db: DbOption = None,
    blobs: Annotated[
        Path | None, typer.Option(help="Folder for array chunks (default: $HYDRAFL_HOME/blobs).")
    ] = None,
    tls_cert: Annotated[
        Path | None, typer.Option(help="Server certificate (PEM); enables TLS.")
    ] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server private key (PEM).")] = None,
    tls_client_ca: Annotated[
        Path | None, typer.Option(help="CA of site certificates (PEM); enables mutual TLS.")
    ] = None,
    lease_stale_s: Annotated[
        float | None,
        typer.Option(
            help="Seconds without a heartbeat after which another coordinator may take over (default 30)."
        ),
    ] = None,
    keep_checkpoints: Annotated[
        int | None,
        typer.Option(
            help="Checkpoints each run keeps (default 2); checkpointed rounds' messages and chunks go."
        ),
    ] = None,
    send_cache_mb: Annotated[
        int | None,
        typer.Option(
            help="Memory for the model a round sends, kept ready for the sites' downloads (default 2048; 0: "
            "off, every download reads the blob files)."
        ),
    ] = None,
    resident_model_mb: Annotated[
        int | None,
        typer.Option(
            help="A global model larger than this (MiB, default 1024) stays on disk in its run folder and "
            "is aggregated tensor by tensor; replies larger stay in the blob store."
        ),
    ] = None,
    track: Annotated[
        str | None,
        typer.Option(
            help="tensorboard:DIR or mlflow:URI to follow every run in (needs the tensorboard or mlflow extra)."
        ),
    ] = None,
    dashboard: Annotated[
        str | None,
        typer.Option(
            help="HOST:PORT (or PORT, on loopback) to serve the read-only web dashboard and /metrics on."
        ),
    ] = None,
    dashboard_token: Annotated[
        str | None,
        typer.Option(
            envvar="HYDRAFL_DASHBOARD_TOKEN",
            show_envvar=True,
            help="Admin token the dashboard asks for.",
        ),
    ] = None,
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose",
            "-v",
            help="Also log details and Flower's own messages (joins, rounds and run ends are always logged).",
        ),
    ] = False,
) -> None:
    """Run the coordinator: serves sites over gRPC and drives queued runs."""
    flags = {
        k.replace("_", "-"): v
        for k, v in locals().items()
        if v is not None and k not in CLI_ONLY_OPTIONS
    }
    from hydrafl.netaddr import check_address
    from hydrafl.server.config import CoordinatorConfig
    from hydrafl.validation import ConfigError

    try:  # the addresses and keys first, torch-free: a typo is refused before the dashboard's imports
        coordinator_config = CoordinatorConfig.load(config, flags)
        if dashboard:
            check_address("--dashboard", dashboard, bare_port=True)
            from hydrafl.server.dashboard import DashboardConfig

        board = (
            DashboardConfig(listen=dashboard, token=dashboard_token or "") if dashboard else None
        )
    except ConfigError as error:
        fail_one_line(str(error), 2)
    import flwr.common.logger  # noqa: F401  (Flower sets its logger's level when imported: before ours, not after)

    setup_logging(verbose)
    serve(coordinator_config, board)


def serve(config: CoordinatorConfig, dashboard: DashboardConfig | None = None) -> None:
    """Start a coordinator on `config` (and its dashboard) and drive runs until interrupted; refusals exit 2, a
    lost lease 1."""
    from hydrafl.server.coordinator import Coordinator
    from hydrafl.server.dashboard import Dashboard
    from hydrafl.server.lease import LeaseHeld
    from hydrafl.server.lease_keeper import LeaseLost
    from hydrafl.server.migrations import SchemaError
    from hydrafl.server.transport.tls import plaintext_warning

    config.home.mkdir(parents=True, exist_ok=True)
    try:
        coordinator = Coordinator(config)
        board = (
            None
            if dashboard is None
            else Dashboard(dashboard, coordinator.store, config.runs_dir, coordinator.service)
        )
        coordinator.start()
    except (OSError, LeaseHeld, SchemaError) as error:
        fail_one_line(str(error), 2)
    signal.signal(signal.SIGTERM, _interrupt)
    mode = config.transport
    if plaintext_warning(config.listen, config.tls):
        mode = "[bold yellow]NO TLS, reachable from the network[/]"
    console.print(
        f"coordinator on {escape(config.listen)} ({mode}); database {escape(config.db_url)}; blobs {config.blob_dir}; "
        f"runs {config.runs_dir}"
    )
    if board is not None:
        _start_dashboard(board)
    why = "an unexpected error (the traceback follows)"
    try:
        coordinator.serve_forever()
    except Terminated:
        why = "SIGTERM"
    except KeyboardInterrupt:
        why = "Ctrl-C"
    except LeaseLost as error:
        why = "it lost its database lease"
        fail_one_line(str(error), 1)
    finally:
        if board is not None:
            board.stop()
        coordinator.stop()
        log.info("coordinator stopped: %s", why)


def _start_dashboard(board: Dashboard) -> None:
    """Serve it, and say where; off loopback, warn that it is plain HTTP."""
    warning = board.config.plaintext_warning
    if warning:
        warn(warning)
    board.start()
    url = escape(board.url)
    console.print(
        f"dashboard on {url} (a browser opens {url}/?token=... once; Prometheus scrapes {url}/metrics)"
    )
