"""`hydrafl server`: run the coordinator until Ctrl-C, SIGTERM or the loss of its database lease."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from hydrafl.cli.common import DbOption, console, fail, fail_one_line, setup_logging

if TYPE_CHECKING:
    from hydrafl.server.config import CoordinatorConfig


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (docker stop, systemd) stops the coordinator as Ctrl-C does: it releases its database lease."""
    raise KeyboardInterrupt


def server(
    config: Annotated[Path | None, typer.Option(help="TOML file with these options' names as keys.")] = None,
    listen: Annotated[str | None, typer.Option(help="HOST:PORT to serve on (default 127.0.0.1:9091).")] = None,
    db: DbOption = None,
    blobs: Annotated[Path | None, typer.Option(help="Folder for array chunks (default: $HYDRAFL_HOME/blobs).")] = None,
    tls_cert: Annotated[Path | None, typer.Option(help="Server certificate (PEM); enables TLS.")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="Server private key (PEM).")] = None,
    tls_client_ca: Annotated[Path | None, typer.Option(help="CA of site certificates (PEM); enables mutual TLS.")] = None,
    lease_stale_s: Annotated[
        float | None,
        typer.Option(help="Seconds without a heartbeat after which another coordinator may take over (default 30)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every round.")] = False,
) -> None:
    """Run the coordinator: serves sites over gRPC and drives queued runs."""
    flags = {k.replace("_", "-"): v for k, v in locals().items() if v is not None and k not in ("config", "verbose")}
    from hydrafl.server.config import CoordinatorConfig
    from hydrafl.validation import ConfigError

    setup_logging(verbose)
    try:
        coordinator_config = CoordinatorConfig.load(config, flags)
    except ConfigError as error:
        fail(escape(str(error)), 2)
    serve(coordinator_config)


def serve(config: CoordinatorConfig) -> None:
    """Start a coordinator on `config` and drive runs until interrupted; refusals exit 2, a lost lease 1."""
    from hydrafl.server.coordinator import Coordinator, LeaseLost
    from hydrafl.server.store import LeaseHeld
    from hydrafl.server.tls import plaintext_warning

    config.home.mkdir(parents=True, exist_ok=True)
    try:
        coordinator = Coordinator(config)
        coordinator.start()
    except (OSError, LeaseHeld) as error:
        fail_one_line(str(error), 2)
    signal.signal(signal.SIGTERM, _interrupt)
    mode = config.transport
    if plaintext_warning(config.listen, config.tls):
        mode = "[bold yellow]NO TLS, reachable from the network[/]"
    console.print(
        f"coordinator on {escape(config.listen)} ({mode}); database {escape(config.db_url)}; blobs {config.blob_dir}; "
        f"runs {config.runs_dir}"
    )
    try:
        coordinator.serve_forever()
    except KeyboardInterrupt:
        pass
    except LeaseLost as error:
        fail_one_line(str(error), 1)
    finally:
        coordinator.stop()
