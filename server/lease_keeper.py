"""This coordinator process's hold on the database lease: the mark in its state folder by which a restarted
process knows its own lease, the keeper that takes, renews and releases it, and the grid it fences (a run's
driver stops at its next poll once the lease is lost, or once an administrator asked the run to stop now)."""

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
from pathlib import Path
from typing import IO, Any

from flwr.app import Message

from hydrafl.server.lease import LeaseClaim, describe_lease, lease_age_s
from hydrafl.server.store import Store
from hydrafl.server.tables import STOP_NOW
from hydrafl.server.transport.grid import CoordinatorGrid

log = logging.getLogger(__name__)

LEASE_MARK = "coordinator.lease"
"""The `LeaseMark` file's name in the coordinator's state folder ($HYDRAFL_HOME)."""
HOLDER_ID = re.compile(r"[0-9a-f]{32}")


class LeaseLost(RuntimeError):
    """Another coordinator took this one's lease over (its heartbeats had stopped): it must stop driving runs."""


class RunStopped(RuntimeError):
    """An administrator stopped the run (`hydrafl admin run stop`): the coordinator records it `stopped`, its
    checkpoints kept, and drives the next run."""


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
    `running` for the coordinator that holds the lease now, which resumes it from its checkpoint. A stop asked
    for `now` raises RunStopped at the next poll: the round in progress is dropped, the last checkpoint stays;
    any stop does so while the run still waits for its sites (it has sent nothing: no round is in progress)."""

    def __init__(self, *args: Any, lease: LeaseKeeper, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease = lease

    def _fence(self) -> None:
        self.lease.check()
        if self.store.stop_requested(self.run.run_id) == STOP_NOW:
            raise RunStopped("stopped by an administrator in the middle of a round")

    def get_node_ids(self) -> Iterable[int]:
        self._fence()
        if not self._types and self.store.stop_requested(self.run.run_id):
            raise RunStopped("stopped by an administrator before its first round here")
        return super().get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        self._fence()
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        self._fence()
        return super().pull_messages(message_ids)
