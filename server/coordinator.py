"""The coordinator process: the gRPC service, the health service, and the loop that drives runs.

Runs are driven one at a time by the same round driver as the simulation. Every run checkpoints each
round into its run folder and is always started with `resume`, so a coordinator restarted after a crash
continues a running run from its last completed round with the strategy state (e.g. outer momentum) intact,
and re-sends the round in progress under the same message ids: the replies already accepted are reused.
A run of a stock Flower ServerApp (`admin run create --server-app`) is instead called once on the same grid
through Flower's own entry point (`hydrafl.server.stock_apps`).

One coordinator per port and per database, or two would drive the same runs: the port is bound without
SO_REUSEPORT, and the database holds a lease that the coordinator takes at start, renews on a heartbeat thread
and releases at stop. A second coordinator is refused while the lease is fresh and takes it over once stale,
or at once when the lease is its own previous process's (`LeaseMark`); a coordinator that finds its lease taken
over stops driving runs. Nothing the loop cannot do or record (a locked database, no descriptors) ends it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import zipfile
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2

from hydrafl.app_bundle import BundleError, importable, unpack
from hydrafl.config import ConfigError, RunConfig
from hydrafl.malloc_tuning import keep_chunk_buffers
from hydrafl.rounds import RoundRecord, metric
from hydrafl.server.blobs import BlobStore
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.lease_keeper import LeasedGrid, LeaseKeeper, LeaseLost, RunStopped
from hydrafl.server.retention import Retention
from hydrafl.server.run_log_file import run_log
from hydrafl.server.server_app import run_federation
from hydrafl.server.stock_app_grid import StockAppGrid
from hydrafl.server.stock_apps import ServerAppError, run_server_app
from hydrafl.server.store import Store
from hydrafl.server.tables import Run
from hydrafl.server.transport.admin_service import MAX_ADMIN_REQUEST_BYTES, AdminService
from hydrafl.server.transport.handlers import (
    SERVICE_NAME,
    add_admin_service,
    add_coordinator_service,
)
from hydrafl.server.transport.sent_cache import SentCache
from hydrafl.server.transport.service import SERVER_OPTIONS, CoordinatorService
from hydrafl.server.transport.tls import ServerTls, plaintext_warning
from hydrafl.tracking import Tracker, TrackTarget

log = logging.getLogger(__name__)

CURVES = ("curves_by_round.png", "curves_by_bytes.png")
"""A tracked run's loss and accuracy curves, by round and by bytes (`hydrafl.curves`)."""
RETRY_AFTER_ERROR_S = 5.0
"""After the loop that drives runs failed (the database refused it, descriptors ran out): wait, then try again."""


def bind(server: grpc.Server, listen: str, tls: ServerTls | None) -> int:
    """The bound port; a port another process holds is an OSError, not a silent second listener."""
    try:
        port = (
            server.add_insecure_port(listen)
            if tls is None
            else server.add_secure_port(listen, tls.credentials())
        )
    except RuntimeError:  # recent grpc raises where older releases returned 0
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {listen}: the address is in use (another coordinator?)")
    return port


class Coordinator:
    """One coordinator process as its CoordinatorConfig describes it; binding the port in the constructor makes a
    port in use an error before the database lease is touched."""

    def __init__(self, config: CoordinatorConfig) -> None:
        self.config = config
        keep_chunk_buffers()  # this process streams chunks from now on
        self.store = Store(config.db_url)
        cache = SentCache(config.send_cache_mb << 20) if config.send_cache_mb else None
        self.blobs = BlobStore(config.blob_dir, cache=cache)
        self.service = CoordinatorService(self.store, self.blobs, config.limits)
        self.health = health.HealthServicer()
        workers = futures.ThreadPoolExecutor(max_workers=config.limits.handler_threads)
        listener = (
            ("grpc.max_allowed_incoming_connections", config.limits.max_connections),
            ("grpc.server_handshake_timeout_ms", round(config.limits.handshake_timeout_s * 1000)),
        )
        self.server = grpc.server(workers, options=(*SERVER_OPTIONS, *listener))
        add_coordinator_service(self.service, self.health, self.server)
        self.admin = AdminService(self.store, config.runs_dir, config.limits)
        add_admin_service(self.admin, self.server, MAX_ADMIN_REQUEST_BYTES)
        self.port = bind(self.server, config.listen, config.tls)
        self.lease = LeaseKeeper(
            self.store, listen=config.listen, stale_s=config.lease_stale_s, state_dir=config.home
        )
        self.retention = Retention(
            self.store, self.blobs, config.runs_dir, keep_checkpoints=config.keep_checkpoints
        )
        self.stopping = threading.Event()

    def start(self) -> None:
        """Take the database's lease, then serve. Raises LeaseHeld (and frees the port) while another coordinator
        holds it."""
        try:
            self.lease.acquire()
        except Exception:
            self.server.stop(None)
            self.service.stop()
            self.admin.stop()
            raise
        self.retention.sweep_orphans()  # what a sweep cut short by a crash left, before anything writes
        warning = plaintext_warning(self.config.listen, self.config.tls)
        if warning:
            log.warning(warning)
        self.server.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self) -> None:
        self.stopping.set()
        self.service.mailbox.close()  # waiting long polls answer now, not at their timeout
        self.server.stop(grace=1).wait()
        self.service.stop()
        self.admin.stop()
        self.lease.release()

    def serve_forever(self, idle_poll_s: float = 0.5) -> None:
        """Drive pending runs until stopped; raises LeaseLost once another coordinator took the database over.
        Anything else (a database that is locked or cannot be opened, a process out of descriptors) is logged and
        tried again after `RETRY_AFTER_ERROR_S`: a run left `running` is resumed then, as after a restart."""
        while not self.stopping.is_set():
            self.lease.check()
            try:
                run = self.store.next_run()
                if run is not None:
                    self.drive(run)
                    self.retention.after_run(run.id)
                    continue
            except LeaseLost:
                raise
            except Exception as error:
                log.error(
                    "coordinator: %s: %s; trying again in %g s",
                    type(error).__name__,
                    error,
                    RETRY_AFTER_ERROR_S,
                )
                self.stopping.wait(RETRY_AFTER_ERROR_S)
                continue
            self.stopping.wait(idle_poll_s)

    def drive(self, run: Run) -> None:
        """Drive `run` to its end, its log lines also in its run folder (`run_log`); a run an administrator
        stopped (`RunStopped`) is recorded `stopped` with its rounds and checkpoints as they are."""
        with run_log(self.config.runs_dir / str(run.id)):
            try:
                if run.server_app:
                    self.drive_server_app(run)
                else:
                    self.drive_own(run)
            except RunStopped as stopped:
                log.warning("run %d stopped: %s", run.id, stopped)
                self.store.set_run_status(run.id, "stopped", detail=str(stopped))

    def drive_own(self, run: Run) -> None:
        try:
            stored = RunConfig.from_flower(run.config, source=f"run {run.id}", other_knobs=True)
        except (
            ConfigError
        ) as error:  # a run this hydrafl cannot read fails alone; the coordinator keeps serving
            log.error("run %d failed: %s", run.id, error)
            self._record_failure(run.id, detail=f"ConfigError: {error}")
            return
        cfg = dataclasses.replace(
            stored, run_dir=str(self.config.runs_dir / str(run.id)), resume=True
        )
        self.store.set_run_status(run.id, "running")
        log.info(
            "run %d started: %s, %d rounds, %d sites required",
            run.id,
            cfg.strategy,
            cfg.rounds,
            cfg.required_sites,
        )
        self.service.latencies.clear()  # push_latency.tsv describes this run only
        grid = LeasedGrid(
            self.store,
            self.blobs,
            self.service,
            run.id,
            lease=self.lease,
            resident_bytes=self.config.resident_model_mb << 20,
        )

        history: list[dict] = list(run.history)
        tracker = self._tracker(run.id, cfg)

        def progress(record: RoundRecord) -> None:
            self.lease.check()
            if tracker is not None:
                tracker.log_round(record)
            history[:] = [entry for entry in history if entry["round"] < record.round] + [
                dataclasses.asdict(record)
            ]
            self.store.set_run_status(run.id, "running", rounds_done=record.round, history=history)
            if self.store.stop_requested(
                run.id
            ):  # the round's checkpoint is committed: resumable from here
                raise RunStopped(f"stopped by an administrator after round {record.round}")
            # the driver committed the checkpoint before; an asynchronous run keeps the versions sites still train on
            settled = (
                record.round
                if record.oldest_open is None
                else min(record.round, record.oldest_open - 1)
            )
            self.retention.after_checkpoint(run.id, settled)

        try:
            run_federation(
                grid,
                cfg,
                on_round=progress,
                resident_model_bytes=self.config.resident_model_mb << 20,
            )
        except LeaseLost:
            log.error(
                "run %d: stopped driving it; the coordinator holding the lease resumes it", run.id
            )
            raise
        except RunStopped:
            raise
        except (
            Exception
        ) as error:  # any failure ends this run, loudly, and the coordinator keeps serving
            log.error("run %d failed: %s", run.id, error)
            self._record_failure(run.id, detail=f"{type(error).__name__}: {error}")
            return
        finally:
            self._write_latencies(run.id)
            if tracker is not None:  # what the run's folder holds, however the run ended
                tracker.log_artifacts(self._run_files(run.id, cfg.strategy, history))
                tracker.close()
        if cfg.job == "stats":
            self.store.set_run_status(run.id, "finished", rounds_done=0)
            log.info("run %d finished: cohort statistics in %s", run.id, cfg.run_dir)
            return
        self.store.set_run_status(run.id, "finished", rounds_done=cfg.rounds)
        last = history[-1] if history else {}
        log.info(
            "run %d finished after %d rounds: loss %s, accuracy %s",
            run.id,
            cfg.rounds,
            metric(last.get("loss")),
            metric(last.get("accuracy")),
        )

    def drive_server_app(self, run: Run) -> None:
        """A stock Flower ServerApp, called once on this coordinator's grid. Like Flower's runtime, this does not
        resume an app: a run left running by a stopped coordinator starts again from its beginning."""
        self.store.set_run_status(run.id, "running", rounds_done=0)
        log.info("run %d started: ServerApp %s", run.id, run.server_app)
        assert run.server_app is not None  # only a stock app's run comes here
        self.service.latencies.clear()
        grid = StockAppGrid(self.store, self.blobs, self.service, run.id, lease=self.lease)
        try:
            with self._app_bundle(run.id, run.server_app):
                run_server_app(grid, run.id, run.server_app, run.config)
        except LeaseLost:
            log.error(
                "run %d: stopped driving it; the coordinator holding the lease starts it again",
                run.id,
            )
            raise
        except RunStopped:
            self.store.set_run_status(run.id, "running", history=grid.history)
            raise
        except ServerAppError as error:
            log.error("run %d failed: %s", run.id, error)
            self._record_failure(run.id, detail=str(error))
            return
        except (Exception, SystemExit) as error:
            where = f"round {grid.train_rounds}: " if grid.train_rounds else ""
            detail = f"{where}ServerApp {run.server_app} raised {type(error).__name__}: {error}"
            log.error("run %d failed: %s", run.id, detail)
            self.store.set_run_status(run.id, "running", history=grid.history)
            self._record_failure(run.id, detail=detail, rounds_done=max(grid.train_rounds - 1, 0))
            return
        finally:
            self._write_latencies(run.id)
        self.store.set_run_status(run.id, "running", history=grid.history)
        if grid.no_successful_reply:
            log.error("run %d failed: %s", run.id, grid.no_successful_reply)
            self._record_failure(run.id, detail=grid.no_successful_reply, rounds_done=0)
            return
        self.store.set_run_status(run.id, "finished", rounds_done=grid.train_rounds)
        log.info(
            "run %d finished: ServerApp %s, %d rounds", run.id, run.server_app, grid.train_rounds
        )

    @contextmanager
    def _app_bundle(self, run_id: int, *server_app: str) -> Iterator[None]:
        """The run's app bundle, when it has one, unpacked into its run folder and importable while it runs."""
        data = self.store.app_bundle(run_id)
        if data is None:
            yield
            return
        try:
            folder = unpack(data, self.config.runs_dir / str(run_id) / "app")
        except (BundleError, zipfile.BadZipFile) as error:
            raise ServerAppError(f"the run's app bundle: {error}") from None
        with importable(folder, *server_app):
            yield

    def _record_failure(self, run_id: int, *, detail: str, rounds_done: int | None = None) -> None:
        """Mark the run failed; when even that fails (the database, the descriptors), say so, wait
        `RETRY_AFTER_ERROR_S` and go on: the run is tried again (from its checkpoint) and may fail again."""
        try:
            self.store.set_run_status(run_id, "failed", detail=detail, rounds_done=rounds_done)
        except Exception as error:
            log.error(
                "run %d: could not record its failure (%s: %s); trying again in %g s",
                run_id,
                type(error).__name__,
                error,
                RETRY_AFTER_ERROR_S,
            )
            self.stopping.wait(RETRY_AFTER_ERROR_S)

    def _tracker(self, run_id: int, cfg: RunConfig) -> Tracker | None:
        """`--track`'s tracker for one run; a tracker that cannot open is logged and the run goes on untracked."""
        if not self.config.track:
            return None
        try:
            return TrackTarget.parse(self.config.track).open(f"run-{run_id}", cfg.to_flower())
        except ConfigError as error:
            log.error("run %d is not tracked: %s", run_id, error)
            return None

    def _run_files(self, run_id: int, strategy: str, history: list[dict]) -> list[Path]:
        """A tracked run's artifacts: its folder's tables, its statistics, and its curves (drawn here)."""
        from hydrafl.curves import plot_curves  # matplotlib: only for a tracked run

        run_dir = self.config.runs_dir / str(run_id)
        if history:
            for name, by_bytes in zip(CURVES, (False, True), strict=True):
                plot_curves(run_dir / name, {strategy: history}, by_bytes=by_bytes)
        names = ("history.json", "rounds.tsv", "push_latency.tsv", *CURVES)
        paths = [run_dir / name for name in names] + sorted(run_dir.glob("stats*"))
        return [path for path in paths if path.is_file()]

    def _write_latencies(self, run_id: int) -> None:
        """push_latency.tsv in the run's folder: per-site P50/P99 of this run's pushes."""
        run_dir = self.config.runs_dir / str(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "push_latency.tsv").write_text(self.service.latency_table())
