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
import fcntl
import logging
import os
import re
import socket
import threading
import uuid
from collections.abc import Iterable, Iterator
from concurrent import futures
from pathlib import Path
from typing import IO, Any

import grpc
from flwr.app import Message, MessageType
from grpc_health.v1 import health, health_pb2

from hydrafl.config import ConfigError, RunConfig
from hydrafl.malloc_tuning import keep_chunk_buffers
from hydrafl.rounds import RoundRecord, metric
from hydrafl.server.blobs import BlobStore
from hydrafl.server.config import CoordinatorConfig
from hydrafl.server.lease import LeaseClaim, describe_lease, lease_age_s
from hydrafl.server.retention import Retention
from hydrafl.server.server_app import run_federation
from hydrafl.server.stock_apps import ServerAppError, run_server_app
from hydrafl.server.store import Store
from hydrafl.server.tables import Run
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.handlers import SERVICE_NAME, add_coordinator_service
from hydrafl.server.transport.sent_cache import SentCache
from hydrafl.server.transport.service import SERVER_OPTIONS, CoordinatorService
from hydrafl.server.transport.tls import ServerTls, plaintext_warning

log = logging.getLogger(__name__)

LEASE_MARK = "coordinator.lease"
"""The `LeaseMark` file's name in the coordinator's state folder ($HYDRAFL_HOME)."""
HOLDER_ID = re.compile(r"[0-9a-f]{32}")
RETRY_AFTER_ERROR_S = 5.0
"""After the loop that drives runs failed (the database refused it, descriptors ran out): wait, then try again."""


class LeaseLost(RuntimeError):
    """Another coordinator took this one's lease over (its heartbeats had stopped): it must stop driving runs."""


class LeaseMark:
    """`coordinator.lease` in the coordinator's state folder: the holder id this folder's coordinator last took
    the lease as, kept locked (flock) while that process lives; the kernel drops the lock when it dies, kill -9
    included. Found unlocked, the mark names a holder that is gone: a lease of that holder on this host is this
    coordinator's own, whatever its pid (a container restarted with pid 1) or heartbeat. Found locked, another
    live coordinator keeps this folder, and nothing is claimed. On a network file system without working locks,
    give each coordinator its own folder."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LEASE_MARK
        self._file: IO[str] | None = None

    def lock(self) -> str | None:
        """Lock the mark and return the holder id it names; None when there is none, or another live process
        holds the mark (then this one never claims a lease as its own)."""
        if (
            not self.path.parent.is_dir()
        ):  # `hydrafl server` creates it; a coordinator in a test may have none
            return None
        try:
            handle = self.path.open("a+")
        except OSError as error:
            log.warning(
                "cannot keep %s (%s): a restart waits for this coordinator's lease to go stale",
                self.path,
                error,
            )
            return None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live coordinator keeps this folder
            handle.close()
            return None
        self._file = handle
        handle.seek(0)
        holder = handle.read(64).strip()
        return holder if HOLDER_ID.fullmatch(holder) else None

    def record(self, holder: str) -> None:
        """Name `holder` as this folder's, for the next process on it (only while this one holds the mark)."""
        if self._file is None:
            return
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(holder + "\n")
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as error:
            log.warning(
                "cannot write %s (%s): a restart waits for this coordinator's lease to go stale",
                self.path,
                error,
            )

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # drops the lock
            self._file = None


class LeaseKeeper:
    """This process's coordinator lease on the database: taken at start, renewed on a daemon thread, released at
    stop. Losing it sets `lost`; the run being driven stops at its next poll of the grid. `state_dir` keeps the
    `LeaseMark` by which a restarted coordinator knows the lease its previous process left."""

    def __init__(
        self, store: Store, *, listen: str, stale_s: float, state_dir: Path | None = None
    ) -> None:
        self.store = store
        self.claim = LeaseClaim(
            holder=uuid.uuid4().hex,
            host=socket.gethostname(),
            pid=os.getpid(),
            listen=listen,
            stale_s=stale_s,
        )
        self.mark = LeaseMark(state_dir) if state_dir is not None else None
        self.lost = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(
            target=self._heartbeat, name="coordinator-lease", daemon=True
        )

    def acquire(self) -> None:
        """Raises LeaseHeld while another coordinator's lease is fresh."""
        if self.mark is not None:
            self.claim = dataclasses.replace(self.claim, restarted_from=self.mark.lock())
        try:
            previous = self.store.acquire_lease(self.claim)
        except BaseException:
            if self.mark is not None:
                self.mark.release()
            raise
        if self.mark is not None:
            self.mark.record(self.claim.holder)
        if previous is not None and previous.holder == self.claim.restarted_from:
            log.warning(
                "took over the lease this coordinator's previous process left (%s)",
                describe_lease(previous, lease_age_s(previous)),
            )
        elif previous is not None:
            log.warning(
                "took over the stale coordinator lease of %s",
                describe_lease(previous, lease_age_s(previous)),
            )
        self._thread.start()

    def check(self) -> None:
        if self.lost.is_set():
            raise LeaseLost(
                "another coordinator took this database's lease over; this one stopped driving runs"
            )

    def release(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()
        try:
            self.store.release_lease(self.claim.holder)
        except Exception as error:
            log.warning(
                "could not release the coordinator lease (%s); it goes stale in %g s",
                error,
                self.claim.stale_s,
            )
        if self.mark is not None:
            self.mark.release()

    def _heartbeat(self) -> None:
        interval_s = self.claim.stale_s / 6
        while not self._stopped.wait(interval_s):
            try:
                held = self.store.renew_lease(self.claim.holder)
            except Exception as error:
                log.warning(
                    "coordinator lease heartbeat failed (%s); retrying in %.1f s", error, interval_s
                )
                continue
            if not held:
                self.lost.set()
                log.error(
                    "LEASE LOST: another coordinator took over this database (%s); this coordinator stops driving runs",
                    self._holder(),
                )
                return

    def _holder(self) -> str:
        try:
            lease = self.store.lease()
        except Exception as error:
            return f"holder unknown: {error}"
        return "lease released" if lease is None else describe_lease(lease, lease_age_s(lease))


class LeasedGrid(CoordinatorGrid):
    """The coordinator's grid, fenced by its lease: once lost, the next poll raises LeaseLost and the run stays
    `running` for the coordinator that holds the lease now, which resumes it from its checkpoint."""

    def __init__(self, *args: Any, lease: LeaseKeeper, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease = lease

    def get_node_ids(self) -> Iterable[int]:
        self.lease.check()
        return super().get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self.lease.check()
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        self.lease.check()
        return super().pull_messages(message_ids)


class StockAppGrid(LeasedGrid):
    """The grid of a stock Flower ServerApp, which reports no rounds of its own: each broadcast of train messages
    is one round (one per round of Flower's `Strategy.start`), so `rounds_done` counts the ones that went before."""

    train_rounds: int = 0

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if any(
            message.metadata.message_type.split(".")[0] == MessageType.TRAIN for message in messages
        ):
            if self.train_rounds:
                self.store.set_run_status(self.run.run_id, "running", rounds_done=self.train_rounds)
            self.train_rounds += 1
        return super().push_messages(messages)


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
        if run.server_app:
            self.drive_server_app(run)
            return
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
        grid = LeasedGrid(self.store, self.blobs, self.service, run.id, lease=self.lease)

        history: list[dict] = list(run.history)

        def progress(record: RoundRecord) -> None:
            self.lease.check()
            history[:] = [entry for entry in history if entry["round"] < record.round] + [
                dataclasses.asdict(record)
            ]
            self.store.set_run_status(run.id, "running", rounds_done=record.round, history=history)
            # the driver committed the checkpoint before; an asynchronous run keeps the versions sites still train on
            settled = (
                record.round
                if record.oldest_open is None
                else min(record.round, record.oldest_open - 1)
            )
            self.retention.after_checkpoint(run.id, settled)

        try:
            run_federation(grid, cfg, on_round=progress)
        except LeaseLost:
            log.error(
                "run %d: stopped driving it; the coordinator holding the lease resumes it", run.id
            )
            raise
        except (
            Exception
        ) as error:  # any failure ends this run, loudly, and the coordinator keeps serving
            log.error("run %d failed: %s", run.id, error)
            self._record_failure(run.id, detail=f"{type(error).__name__}: {error}")
            return
        finally:
            self._write_latencies(run.id)
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
            run_server_app(grid, run.id, run.server_app, run.config)
        except LeaseLost:
            log.error(
                "run %d: stopped driving it; the coordinator holding the lease starts it again",
                run.id,
            )
            raise
        except ServerAppError as error:
            log.error("run %d failed: %s", run.id, error)
            self._record_failure(run.id, detail=str(error))
            return
        except (Exception, SystemExit) as error:
            log.error(
                "run %d failed: ServerApp %s raised %s: %s",
                run.id,
                run.server_app,
                type(error).__name__,
                error,
            )
            detail = f"ServerApp {run.server_app} raised {type(error).__name__}: {error}"
            self._record_failure(run.id, detail=detail, rounds_done=max(grid.train_rounds - 1, 0))
            return
        finally:
            self._write_latencies(run.id)
        self.store.set_run_status(run.id, "finished", rounds_done=grid.train_rounds)
        log.info(
            "run %d finished: ServerApp %s, %d rounds", run.id, run.server_app, grid.train_rounds
        )

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

    def _write_latencies(self, run_id: int) -> None:
        """push_latency.tsv in the run's folder: per-site P50/P99 of this run's pushes."""
        run_dir = self.config.runs_dir / str(run_id)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "push_latency.tsv").write_text(self.service.latency_table())
