"""The coordinator process: the gRPC service, the health service, and the loop that drives runs.

Runs are driven one at a time by the same round driver as the simulation. Every run checkpoints each
round into its run folder and is always started with `resume`, so a coordinator restarted after a crash
continues a running run from its last completed round with the strategy state (e.g. outer momentum) intact,
and re-sends the round in progress under the same message ids: the replies already accepted are reused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hydrafl.server_app import run_federation
from hydrafl.config import RunConfig
from hydrafl.driver import RoundRecord
from hydrafl.proto.coordinator_pb2_grpc import add_CoordinatorServicer_to_server
from hydrafl.server.blobs import BlobStore
from hydrafl.server.grid import CoordinatorGrid
from hydrafl.server.service import GRPC_OPTIONS, CoordinatorService
from hydrafl.server.store import Run, Store

log = logging.getLogger(__name__)
SERVICE_NAME = "hydrafl.proto.Coordinator"


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerTls:
    """PEM files. With `client_ca`, every site must present a certificate signed by it (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None

    def credentials(self) -> grpc.ServerCredentials:
        root = self.client_ca.read_bytes() if self.client_ca else None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=root,
            require_client_auth=root is not None,
        )


class Coordinator:
    def __init__(
        self, *, listen: str, db_url: str, blob_dir: Path, runs_dir: Path, tls: ServerTls | None = None
    ) -> None:
        self.store = Store(db_url)
        self.blobs = BlobStore(blob_dir)
        self.runs_dir = runs_dir
        self.service = CoordinatorService(self.store, self.blobs)
        self.health = health.HealthServicer()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=GRPC_OPTIONS)
        add_CoordinatorServicer_to_server(self.service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if tls is None:
            self.port = self.server.add_insecure_port(listen)
        else:
            self.port = self.server.add_secure_port(listen, tls.credentials())
        if self.port == 0:
            raise OSError(f"cannot listen on {listen}")
        self.stopping = threading.Event()

    def start(self) -> None:
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.stopping.set()
        self.server.stop(grace=1).wait()

    def serve_forever(self, idle_poll_s: float = 0.5) -> None:
        """Drive pending runs until stopped."""
        while not self.stopping.is_set():
            run = self.store.next_run()
            if run is None:
                self.stopping.wait(idle_poll_s)
                continue
            self.drive(run)

    def drive(self, run: Run) -> None:
        cfg = dataclasses.replace(
            RunConfig.from_flower(run.config), run_dir=str(self.runs_dir / str(run.id)), resume=True
        )
        self.store.set_run_status(run.id, "running")
        self.service.latencies.clear()  # push_latency.tsv describes this run only
        grid = CoordinatorGrid(self.store, self.blobs, self.service, run.id)

        history: list[dict] = list(run.history)

        def progress(record: RoundRecord) -> None:
            history[:] = [entry for entry in history if entry["round"] < record.round] + [dataclasses.asdict(record)]
            self.store.set_run_status(run.id, "running", rounds_done=record.round, history=history)

        try:
            run_federation(grid, cfg, on_round=progress)
        except Exception as error:  # any failure ends this run, loudly, and the coordinator keeps serving
            log.error("run %d failed: %s", run.id, error)
            self.store.set_run_status(run.id, "failed", detail=f"{type(error).__name__}: {error}")
            return
        finally:
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            (Path(cfg.run_dir) / "push_latency.tsv").write_text(self.service.latency_table())
        self.store.set_run_status(run.id, "finished", rounds_done=cfg.rounds)
