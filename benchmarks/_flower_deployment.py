"""The stock Flower app (`_stock_app`) deployed on Flower's own runtime: a SuperLink and SuperNodes on loopback
(insecure, Flower 1.42 defaults otherwise: each ServerApp and ClientApp runs in a subprocess its SuperExec
starts), the run submitted with `flwr run APP_DIR CONNECTION --stream` as a Flower user would. No network
beyond loopback: the app's dependencies are already installed (`--disable-runtime-dependency-installation`),
telemetry and update checks are off, and all of Flower's state lives under `$FLWR_HOME` in the caller's
folder, never in ~/.flwr. `round_overhead` compares its rounds with the same app on hydrafl's coordinator.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

from hydrafl.benchmarks._stock_app import ROUND_TIMES_KEY

STOCK_MODULE = "hydrafl.benchmarks._stock_app"
STOCK_SERVER_APP = f"{STOCK_MODULE}:server_app"
STOCK_CLIENT_APP = f"{STOCK_MODULE}:client_app"
CONNECTION = "bench"

# `flwr run` packs this folder into a FAB; the SuperLink and SuperNodes unpack it under $FLWR_HOME/apps and load
# the components from there, so the module re-exports the installed app. `[tool.flwr.app.config]` lists every
# key a run may override (Flower drops `--run-config` keys the app does not declare).
PYPROJECT = f"""[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "round-overhead"
version = "1.0.0"
description = "hydrafl's round_overhead benchmark: the stock app on Flower's deployment runtime"
license = "Apache-2.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["."]

[tool.flwr.app]
publisher = "hydrafl"

[tool.flwr.app.components]
serverapp = "round_app:server_app"
clientapp = "round_app:client_app"

[tool.flwr.app.config]
num-server-rounds = 3
{ROUND_TIMES_KEY} = ""
"""
APP_MODULE = f'''"""The benchmark's stock app, installed with hydrafl."""
from {STOCK_MODULE} import client_app, server_app

__all__ = ["client_app", "server_app"]
'''


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_listening(port: int, process: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    """Until something accepts on the port: `flwr run` does not retry a SuperLink that is still starting."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"flower-superlink exited with {process.returncode} before listening"
            )
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"flower-superlink did not listen on {port} in {timeout_s:.0f} s")


def stop(processes: list[subprocess.Popen[bytes]], grace_s: float = 10) -> None:
    """SIGTERM each process's group (a SuperNode's SuperExec and app subprocesses share it; the SuperLink stops
    its own detached SuperExec on SIGTERM), then SIGKILL what is left after `grace_s`."""
    for process in processes:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(
                process.pid, signal.SIGKILL
            )  # also any child of the group that outlived its parent
        except ProcessLookupError:
            pass
        process.wait()


def flower_round_seconds(
    rounds: int, sites: int, work: Path, timeout_s: float = 900
) -> list[float]:
    """Each round's seconds of the stock app on a SuperLink with `sites` SuperNodes, as its ServerApp timed them."""
    bin_dir = str(
        Path(sys.executable).parent
    )  # the SuperLink and SuperNodes start `flower-superexec` by name
    env = {
        **os.environ,
        "FLWR_HOME": str(work / "flwr-home"),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "OMP_NUM_THREADS": "1",
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
    }
    port = free_port()
    (work / "flwr-home").mkdir(parents=True)
    (work / "flwr-home" / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n'
        f'[superlink.{CONNECTION}]\naddress = "127.0.0.1:{port}"\ninsecure = true\n'
    )
    app_dir = work / "flower-app"
    app_dir.mkdir()
    (app_dir / "pyproject.toml").write_text(PYPROJECT)
    (app_dir / "round_app.py").write_text(APP_MODULE)
    times = work / "flower-round-times.json"
    log: IO[bytes] = (work / "flower.log").open("wb")
    processes: list[subprocess.Popen[bytes]] = []

    def start(*command: str) -> subprocess.Popen[bytes]:
        process = subprocess.Popen(
            [os.path.join(bin_dir, command[0]), *command[1:]],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        processes.append(process)
        return process

    try:
        superlink = start(
            "flower-superlink",
            "--insecure",
            "--disable-runtime-dependency-installation",
            "--port",
            str(port),
        )
        for site in range(sites):
            start(
                "flower-supernode",
                "--insecure",
                "--superlink",
                f"127.0.0.1:{port}",
                "--port",
                str(free_port()),
                "--node-config",
                f"partition-id={site} num-partitions={sites}",
            )
        wait_listening(port, superlink)
        run_config = f'num-server-rounds={rounds} {ROUND_TIMES_KEY}="{times}"'
        submitted = subprocess.run(
            [
                os.path.join(bin_dir, "flwr"),
                "run",
                str(app_dir),
                CONNECTION,
                "--run-config",
                run_config,
                "--stream",
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )  # --stream returns when the run has ended
        if submitted.returncode != 0 or not times.exists():
            log.flush()
            tail = (work / "flower.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(
                f"the Flower run failed (flwr run exited {submitted.returncode}); log tail:\n{tail}"
            )
        return [float(seconds) for seconds in json.loads(times.read_text())]
    finally:
        stop(processes)
        log.close()
