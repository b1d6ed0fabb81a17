"""Real coordinator and site processes for end-to-end tests: start them, wait for them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hydrafl.config import RunConfig
from hydrafl.secagg import SiteIdentity
from hydrafl.secagg.identity import new_signing_key
from hydrafl.server.store import Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_hydrafl(*args: str, env: dict, log: Path, verbose: bool = True) -> subprocess.Popen:
    with log.open("a") as handle:
        command = [sys.executable, "-m", "hydrafl", *args, *(["-v"] if verbose else [])]
        return subprocess.Popen(command, env=env, stdout=handle, stderr=handle)


def wait_serving(
    address: str, timeout_s: float = 60, process: subprocess.Popen | None = None
) -> None:
    """Until the coordinator's health check says SERVING (or `process`, the coordinator, exits)."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and (process is None or process.poll() is None):
            try:
                if (
                    stub.Check(
                        health_pb2.HealthCheckRequest(service="hydrafl.proto.Coordinator"),
                        timeout=1,
                    ).status
                    == 1
                ):
                    return
            except grpc.RpcError:
                time.sleep(0.2)
    raise TimeoutError(
        f"coordinator on {address} never reported SERVING"
        + (f" (exit {process.poll()})" if process else "")
    )


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise TimeoutError(what)


def wait_joined(logs: list[Path], timeout_s: float = 120) -> None:
    """Until every site process logging to one of `logs` has joined the coordinator (a run queued before then
    may start with the first sites and sample only them)."""
    wait_until(
        lambda: all("joined as" in log.read_text() for log in logs),
        timeout_s,
        "a site did not join",
    )


def enrol(tmp_path: Path, cfg: RunConfig) -> tuple[dict, str, Store, list[str], str]:
    """A coordinator's database with `cfg.sites` sites: (env, db url, store, tokens, address to listen on)."""
    env = {**os.environ, "HYDRAFL_HOME": str(tmp_path / "home")}
    db = f"sqlite:///{tmp_path / 'coordinator.db'}"
    store = Store(db)
    tokens = [store.add_site(f"hospital-{i}")[1] for i in range(cfg.sites)]
    return env, db, store, tokens, f"127.0.0.1:{free_port()}"


def queue_run(store: Store, cfg: RunConfig) -> int:
    """Queue `cfg` as the coordinator's next run; returns its id."""
    return store.create_run(
        {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")}
    ).id


def run_to_end(
    tmp_path: Path,
    cfg: RunConfig,
    site_options: list[tuple[str, ...]],
    timeout_s: float = 300,
    server_options: tuple[str, ...] = (),
) -> tuple[Store, int]:
    """`cfg` run by a coordinator process (with `server_options`) and one `hydrafl site` process per enrolled
    site (each with its own extra options), waited for until it finishes or fails; every process is killed
    after. Returns the coordinator's store and the run id. The run is queued once every site has joined: with
    `min_sites` below the sites, a run queued earlier starts with the first ones and samples only them."""
    env, db, store, tokens, address = enrol(tmp_path, cfg)
    processes = [
        start_hydrafl(
            "server",
            "--listen",
            address,
            "--db",
            db,
            "--blobs",
            str(tmp_path / "blobs"),
            *server_options,
            env=env,
            log=tmp_path / "coordinator.log",
        )
    ]
    try:
        wait_serving(address, process=processes[0])
        identities = _secagg_identities(tmp_path, store) if cfg.secagg else [()] * len(tokens)
        for i, (token, options, identity) in enumerate(
            zip(tokens, site_options, identities, strict=True)
        ):
            processes.append(
                start_hydrafl(
                    "site",
                    "--coordinator",
                    address,
                    "--token",
                    token,
                    *options,
                    *identity,
                    env=env,
                    log=tmp_path / f"site-{i}.log",
                )
            )
        wait_joined([tmp_path / f"site-{i}.log" for i in range(len(tokens))])
        run_id = queue_run(store, cfg)
        wait_until(
            lambda: store.run(run_id).status in ("finished", "failed"),
            timeout_s,
            "the run did not finish",
        )
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return store, run_id


def _secagg_identities(tmp_path: Path, store: Store) -> list[tuple[str, ...]]:
    """Per enrolled site, the --secagg-identity option of an identity the test's consortium key certified."""
    consortium, options = new_signing_key(), []
    for site in store.sites():
        path = tmp_path / f"{site.name}.secagg-identity.json"
        path.write_text(SiteIdentity.issue(consortium, site.node_id).to_json())
        options.append(("--secagg-identity", str(path)))
    return options
