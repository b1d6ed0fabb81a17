"""A coordinator process and site processes on one machine, for the reliability campaign and its tests: start
them, kill them, restart the coordinator on the same database and blobs, and read what a run left behind
(final arrays, per-round history, accepted updates, stored rows and blobs)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import func, select

from hydrafl.config import RunConfig
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.store import Store
from hydrafl.server.tables import OutboundMessage, Reply

RUN = RunConfig(
    task="tabular", sites=3, samples_per_site=60, rounds=10, local_steps=3, batch_size=16, lr=3e-3
)
"""Three small tabular sites under FedAvg with the default seed: a deterministic 10-round run of ~30 s."""
LEASE_STALE_S = 1.0
"""A restarted coordinator takes over the killed one's lease after this long (the default 30 s would only
make every restart wait)."""
Limits = dict[int, tuple[int, int]]
"""Resource limits for a started process: `resource.RLIMIT_*` -> (soft, hard)."""


def free_port() -> int:
    """A port nothing listens on now, for the next coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def set_limits(process: subprocess.Popen, limits: Limits) -> None:
    """`limits` on a process that has started (before it is serving: the interpreter is still importing). Not a
    `preexec_fn`: forking a process with threads (the test runner's gRPC and torch pools) and running Python in
    the child before exec can deadlock or abort it (exit -6 in CI)."""
    for which, values in limits.items():
        resource.prlimit(process.pid, which, values)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` until true; a TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(what)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunOutcome:
    """What a finished (or failed) run left: enough to compare it bit for bit with another."""

    status: str
    detail: str
    arrays: dict[str, np.ndarray]
    sites_ok: list[int]
    accepted: list[str]
    declined: list[str]
    replies: int

    def same_model(self, other: RunOutcome) -> bool:
        """Bitwise equality of every final array (same names, dtypes, shapes and bytes)."""
        return self.arrays.keys() == other.arrays.keys() and all(
            a.dtype == other.arrays[k].dtype
            and a.shape == other.arrays[k].shape
            and a.tobytes() == other.arrays[k].tobytes()
            for k, a in self.arrays.items()
        )


class Cluster:
    """One coordinator home (SQLite database, blobs, run folders) under `root`, enrolled sites, and the processes
    started on it; `close()` kills every process still alive."""

    def __init__(
        self, root: Path, site_names: Sequence[str], *, listen_host: str = "127.0.0.1"
    ) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.env = {
            **os.environ,
            "HYDRAFL_HOME": str(root / "home"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "COLUMNS": "200",
        }
        self.db = f"sqlite:///{root / 'coordinator.db'}"
        self.store = Store(self.db)
        self.tokens = {name: self.store.add_site(name)[1] for name in site_names}
        self.port = free_port()
        self.listen = f"{listen_host}:{self.port}"
        self.address = f"127.0.0.1:{self.port}"
        self.coordinator: subprocess.Popen | None = None
        self.sites: dict[str, subprocess.Popen] = {}
        self._processes: list[subprocess.Popen] = []

    def queue(self, cfg: RunConfig) -> int:
        """Queue `cfg` as the coordinator's next run; its id."""
        config = {k: v for k, v in cfg.to_flower().items() if k not in ("run-dir", "resume")}
        return self.store.create_run(config).id

    def _spawn(
        self,
        args: Sequence[str],
        log: Path,
        extra_env: dict[str, str] | None = None,
        limits: Limits | None = None,
    ) -> subprocess.Popen:
        with log.open("a") as handle:
            process = subprocess.Popen(
                [sys.executable, "-m", "hydrafl", *args],
                env={**self.env, **(extra_env or {})},
                stdout=handle,
                stderr=handle,
            )
        set_limits(process, limits or {})
        self._processes.append(process)
        return process

    def start_coordinator(
        self,
        timeout_s: float = 120,
        *options: str,
        extra_env: dict[str, str] | None = None,
        limits: Limits | None = None,
    ) -> subprocess.Popen:
        """A coordinator on the cluster's database and blobs (and `options`, e.g. `--dashboard`), waited for until
        SERVING. A restart right after a kill may find the dead one's lease still fresh (exit 2): it is started
        again until it takes over."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.coordinator = self._spawn(
                [
                    "server",
                    "--listen",
                    self.listen,
                    "--db",
                    self.db,
                    "--blobs",
                    str(self.root / "blobs"),
                    "--lease-stale-s",
                    str(LEASE_STALE_S),
                    *options,
                ],
                self.root / "coordinator.log",
                extra_env,
                limits,
            )
            if self.wait_serving(deadline - time.monotonic()):
                return self.coordinator
            if self.coordinator.poll() != 2 or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the coordinator did not start (exit {self.coordinator.poll()}); see "
                    f"{self.root / 'coordinator.log'}"
                )
            time.sleep(0.3)

    def wait_serving(self, timeout_s: float) -> bool:
        """True once the health check says SERVING; False when the coordinator exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while (
                time.monotonic() < deadline
                and self.coordinator is not None
                and self.coordinator.poll() is None
            ):
                try:
                    request = health_pb2.HealthCheckRequest(service="hydrafl.proto.Coordinator")
                    if (
                        stub.Check(request, timeout=1).status
                        == health_pb2.HealthCheckResponse.SERVING
                    ):
                        return True
                except grpc.RpcError:
                    time.sleep(0.1)
        return False

    def healthy(self) -> bool:
        """The coordinator process is alive and answers its health check."""
        return (
            self.coordinator is not None
            and self.coordinator.poll() is None
            and self.wait_serving(5)
        )

    def kill_coordinator(self) -> None:
        """kill -9: no shutdown code runs, the lease stays as it was."""
        assert self.coordinator is not None
        self.coordinator.send_signal(signal.SIGKILL)
        self.coordinator.wait()

    def start_site(
        self,
        name: str,
        *options: str,
        extra_env: dict[str, str] | None = None,
        limits: Limits | None = None,
    ) -> subprocess.Popen:
        """`hydrafl site` for enrolled site `name` (its token through the environment), logging to site-NAME.log."""
        env = {"HYDRAFL_SITE_TOKEN": self.tokens[name], **(extra_env or {})}
        self.sites[name] = self._spawn(
            ["site", "--coordinator", self.address, *options], self.site_log(name), env, limits
        )
        return self.sites[name]

    def site_log(self, name: str) -> Path:
        """Where site `name`'s process logs."""
        return self.root / f"site-{name}.log"

    def wait_run(self, run_id: int, timeout_s: float) -> str:
        """The run's status once it has finished or failed."""
        wait_until(
            lambda: self.store.run_status(run_id) in ("finished", "failed"),
            timeout_s,
            f"run {run_id} did not end",
        )
        return self.store.run_status(run_id) or ""

    def outcome(self, run_id: int) -> RunOutcome:
        """What run `run_id` left: its final checkpoint's arrays, per-round sites, audited replies."""
        run = self.store.run(run_id)
        checkpoint = load_checkpoint(self.root / "home" / "runs" / str(run_id))
        arrays = (
            {}
            if checkpoint is None
            else {k: np.array(v.numpy()) for k, v in checkpoint.arrays.items()}
        )
        with self.store.session() as session:
            replies = (
                session.scalar(
                    select(func.count()).select_from(Reply).where(Reply.run_id == run_id)
                )
                or 0
            )
        return RunOutcome(
            status=run.status,
            detail=run.detail or "",
            arrays=arrays,
            sites_ok=[int(r.get("sites_ok", 0)) for r in run.history if r["round"] >= 1],
            accepted=[
                e.detail for e in self.store.audit_events("update-accepted") if e.run_id == run_id
            ],
            declined=[
                e.detail for e in self.store.audit_events("site-declined") if e.run_id == run_id
            ],
            replies=int(replies),
        )

    def settled(self, timeout_s: float = 60) -> dict[str, set[str]]:
        """`stored()` once it has not changed for 2 s: a run's end is followed by its storage sweep."""
        deadline = time.monotonic() + timeout_s
        last = self.stored()
        while time.monotonic() < deadline:
            time.sleep(2)
            now = self.stored()
            if now == last:
                return now
            last = now
        return last

    def stored(self) -> dict[str, set[str]]:
        """Every stored reply and outbound message (by id) and every blob file (by path): what a hostile
        request must not add to."""
        with self.store.session() as session:
            replies = {
                f"{r.reply_to_message_id}@{r.node_id}" for r in session.scalars(select(Reply))
            }
            outbound = set(session.scalars(select(OutboundMessage.message_id)))
        blobs_dir = self.root / "blobs"
        blobs = (
            {str(p.relative_to(blobs_dir)) for p in blobs_dir.rglob("*") if p.is_file()}
            if blobs_dir.exists()
            else set()
        )
        return {"replies": replies, "outbound": outbound, "blobs": blobs}

    def close(self) -> None:
        """Kill every process still alive; the folder stays for its logs."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
            process.wait()
        self.store.engine.dispose()


def run_clean(root: Path, cfg: RunConfig, timeout_s: float = 600) -> tuple[RunOutcome, float]:
    """`cfg` on a coordinator with `cfg.sites` site processes, uninterrupted: its outcome and wall seconds."""
    cluster = Cluster(root, [f"hospital-{i}" for i in range(cfg.sites)])
    try:
        run_id = cluster.queue(cfg)
        cluster.start_coordinator()
        started = time.perf_counter()
        for name in cluster.tokens:
            cluster.start_site(name)
        cluster.wait_run(run_id, timeout_s)
        return cluster.outcome(run_id), time.perf_counter() - started
    finally:
        cluster.close()


def cluster_wait(
    predicate: Callable[[], bool], cluster: Cluster, run_id: int, timeout_s: float = 600
) -> None:
    """Until `predicate()`; the run failing first is an error naming its reason."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if (
            cluster.store.run_status(run_id) in ("finished", "failed")
            or time.monotonic() > deadline
        ):
            raise RuntimeError(
                f"run {run_id} ended ({cluster.store.run(run_id).detail}) before the attacker was ready"
            )
        time.sleep(0.2)
