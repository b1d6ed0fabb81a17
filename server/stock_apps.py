"""Stock Flower ServerApps on the coordinator's grid, started as `flwr run` starts them on Flower's own runtime.

A run queued with `hydrafl admin run create --server-app module:attr --run-config key=value` stores the
reference and its run_config (typed as `flwr run --run-config` types it: values are TOML scalars). The
coordinator loads the app, gives it a Context holding that run_config and calls it through Flower's own entry
point (`flwr.server.run_serverapp.run`) with its Grid, so any ServerApp that runs under `flwr run` runs here.
The app runs inside the coordinator process: a reference names a module on the coordinator's Python path (or
its working directory), nothing is installed from a run.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from click import ClickException
from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.server.run_serverapp import run as run_flower_server_app
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.server_app import LoadServerAppError
from flwr.supercore.object_ref import load_app, validate
from flwr.supercore.run import Run as FlowerRun


class ServerAppError(ValueError):
    """A ServerApp reference or run_config that cannot be used; the message is one line and says why."""


class ServerAppNotFound(ServerAppError):
    """The reference's module is not on this machine's Python path (it may be on the coordinator's)."""


def _one_line(text: str) -> str:
    return " ".join(text.split())


def load_server_app(reference: str) -> ServerApp:
    """The ServerApp at module:attribute. Importing runs the module's code, so any failure there is a reason in
    the error, never a traceback; a missing module is ServerAppNotFound."""
    valid, _ = validate(reference, check_module=False)
    if not valid:
        raise ServerAppError(
            f"{reference!r} is not a module:attribute reference (e.g. my_app.server_app:app)"
        )
    module_name, _, attribute = reference.partition(":")
    cannot = f"cannot load ServerApp {reference!r}"
    try:
        app = load_app(reference, LoadServerAppError)
    except LoadServerAppError:
        raise ServerAppError(
            f"{cannot}: module {module_name} has no attribute {attribute}"
        ) from None
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if missing and (module_name == missing or module_name.startswith(f"{missing}.")):
            raise ServerAppNotFound(f"{cannot}: no module named {missing!r}") from None
        raise ServerAppError(f"{cannot}: {_one_line(str(error))}") from None
    except Exception as error:
        raise ServerAppError(f"{cannot}: {type(error).__name__}: {_one_line(str(error))}") from None
    if not isinstance(app, ServerApp):
        raise ServerAppError(f"{reference!r} is a {type(app).__name__}, not a flwr ServerApp")
    return app


def parse_run_config(entries: list[str]) -> dict[str, Any]:
    """`--run-config` values as Flower's `flwr run --run-config` parses them: `key=value` pairs (several may
    share one argument, separated by spaces) whose values are TOML scalars (`2`, `0.1`, `true`, `"text"`), or
    one .toml file."""
    for entry in entries:
        if "=" not in entry and not entry.endswith(".toml"):
            raise ServerAppError(
                f'--run-config {entry!r} is not key=value (a string value is quoted: name="text")'
            )
    try:
        return parse_config_args(entries)
    except ClickException as error:
        raise ServerAppError(f"--run-config: {_one_line(error.message)}") from None
    except (ValueError, OSError) as error:
        raise ServerAppError(f"--run-config: {_one_line(str(error))}") from None


def run_server_app(grid: Grid, run_id: int, reference: str, run_config: dict[str, Any]) -> None:
    """Load the ServerApp at `reference` and run it to its end on `grid`, as Flower's runtime does: the grid is
    set to the run, the Context carries the run_config. Raises ServerAppError for a reference that does not load
    and whatever the app raises."""
    app = load_server_app(reference)
    grid.set_run(
        dataclasses.replace(FlowerRun.create_empty(run_id), override_config=dict(run_config))
    )
    context = Context(
        run_id=run_id,
        node_id=SUPERLINK_NODE_ID,
        node_config={},
        state=RecordDict(),
        run_config=dict(run_config),
    )
    run_flower_server_app(
        grid=grid, context=context, server_app_dir=str(Path.cwd()), loaded_server_app=app
    )
