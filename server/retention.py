"""Storage that stays bounded: the coordinator deletes what no run can need again, as soon as it cannot.

What goes, and when:
- Rounds 1..r of a running run (their messages, replies, and the chunks only they refer to) once round r's
  checkpoint is committed: a resume starts at round r + 1 and never sends them again. Round 0 (the initial-model
  query, the stability probes, the initial evaluation) stays until the run ends, because a resume asks it again
  under the same message ids and reuses the stored replies.
- An ended run (finished or failed) loses its messages, replies and chunks; it keeps its run row (history), its
  audit events and its run folder (rounds.tsv, history.json, its last checkpoints: the newest is its final model).
- Each run folder keeps the last `keep_checkpoints` rounds' checkpoints
  (`hydrafl.server.aggregation.checkpoint.archive_checkpoint`).
- A stock Flower ServerApp restarts from its beginning and reuses its stored replies: its rows go at its end only.
- A chunk goes only when no remaining row refers to it (messages refer to chunks at the blob store's root, replies
  to chunks in their site's namespace). A site that may still answer a message has uploads in flight: its
  namespace is left alone until it has nothing left to answer.

Crash safety comes from the order: the checkpoint is committed first (the driver writes it before its round
callback), then the rows go in one transaction, then the chunks, each only if no row left refers to it. So a
kill -9 at any point leaves at worst chunks that no row refers to (orphans), never a row whose chunk is missing;
every sweep recomputes what is live from the database, so the next one (each round, and at coordinator start
before it serves) deletes those orphans: sweeps are idempotent.

`hydrafl admin gc` may run beside a serving coordinator, whose next push may re-use a chunk the sweep found
unreferenced: a put refreshes the write time of a chunk it finds stored (a chunk file's mtime, a pack slot's
header), and a sweep beside a live coordinator spares chunks younger than ORPHAN_GRACE_S.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from google.protobuf.message import DecodeError
from sqlalchemy import CursorResult, delete, func, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import EnvelopeError, chunk_hashes
from hydrafl.server.aggregation.checkpoint import archive_checkpoint, stale_checkpoints
from hydrafl.server.blobs import BlobStore
from hydrafl.server.config import DEFAULT_KEEP_CHECKPOINTS
from hydrafl.server.lease import lease_age_s
from hydrafl.server.store import Store
from hydrafl.server.tables import AuditEvent, OutboundMessage, Reply, Run
from hydrafl.server.transport.packs import UploadPacks

log = logging.getLogger(__name__)

SWEEP_PAUSE_ENV = "HYDRAFL_TEST_SWEEP_PAUSE_S"
"""Test hook: seconds a sweep sleeps after its first chunk deletion, so a test can kill -9 it mid-sweep."""
ORPHAN_GRACE_S = 3600.0
"""Beside a live coordinator, unreferenced chunks younger than this are spared (a push may be re-using them)."""
ENDED = ("finished", "failed")
DELETING = "deleting"
"""The status of a run `delete_run` is removing: no coordinator drives it."""
BATCH = 500
"""Rows deleted per statement (SQLite bounds the parameters of one statement)."""

Doomed = Callable[[int, int], bool]
"""(run id, server round) of a message -> whether it and its reply go."""


class RunRunning(ValueError):
    """A running run cannot be deleted: a coordinator is driving it."""


@dataclass(kw_only=True, slots=True)
class SweepReport:
    """What a sweep deleted (or, dry, would delete)."""

    messages: int = 0
    replies: int = 0
    chunks: int = 0
    chunk_bytes: int = 0
    files: int = 0
    """Run-folder files: older checkpoints, or a deleted run's whole folder."""
    file_bytes: int = 0

    def describe(self) -> str:
        return (
            f"{self.messages} messages, {self.replies} replies, {self.chunks} chunks "
            f"({self.chunk_bytes / 1e6:.2f} MB), {self.files} run-folder files ({self.file_bytes / 1e6:.2f} MB)"
        )


class Retention:
    """The deletions of one coordinator home: its database, blob store and run folders."""

    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        runs_dir: Path,
        *,
        keep_checkpoints: int = DEFAULT_KEEP_CHECKPOINTS,
        dry_run: bool = False,
        grace_s: float = 0.0,
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.runs_dir = runs_dir
        self.keep_checkpoints = keep_checkpoints
        self.dry_run = dry_run
        self.grace_s = grace_s

    @classmethod
    def beside(cls, store: Store, blobs: BlobStore, runs_dir: Path, **options: Any) -> Retention:
        """For a process other than the coordinator (`hydrafl admin gc`): with a grace while a coordinator's
        lease is fresh, since that coordinator may be re-using chunks right now."""
        lease = store.lease()
        live = lease is not None and lease_age_s(lease) < lease.stale_s
        return cls(store, blobs, runs_dir, grace_s=ORPHAN_GRACE_S if live else 0.0, **options)

    # --- the coordinator's sweeps: best effort, a failure is retried by the next one ---------------------------

    def after_checkpoint(self, run_id: int, server_round: int) -> SweepReport:
        """Round `server_round` of a running run is checkpointed: its rounds 1..server_round go."""
        report = SweepReport()
        with _best_effort(f"run {run_id} round {server_round}"):
            self._prune_checkpoints(self.runs_dir / str(run_id), report, server_round=server_round)
            self._sweep(lambda run, server: run == run_id and 1 <= server <= server_round, report)
        log.debug(
            "storage sweep after run %d round %d: %s", run_id, server_round, report.describe()
        )
        return report

    def after_run(self, run_id: int) -> SweepReport:
        """A run the coordinator stopped driving: once ended, its messages, replies and chunks go."""
        report = SweepReport()
        with _best_effort(f"run {run_id}"):
            if self.store.run_status(run_id) in ENDED:
                self._sweep(lambda run, _: run == run_id, report)
                log.info("run %d ended; deleted %s", run_id, report.describe())
        return report

    def sweep_orphans(self) -> SweepReport:
        """At coordinator start, before serving: what a sweep cut short left (chunks no row refers to, partial
        writes). Nothing writes yet, so nothing is spared."""
        report = SweepReport()
        with _best_effort("start"):
            self._sweep(lambda run, server: False, report, partials=True)
        if report.chunks:
            log.info("deleted what an interrupted sweep left: %s", report.describe())
        return report

    # --- the operators' ----------------------------------------------------------------------------------------

    def collect(self) -> SweepReport:
        """`hydrafl admin gc`: every ended run's messages, replies and chunks, every run folder's older
        checkpoints, and the orphans."""
        report = SweepReport()
        for folder in sorted(self.runs_dir.glob("*")) if self.runs_dir.is_dir() else []:
            self._prune_checkpoints(folder, report)
        ended = {run.id for run in self.store.runs() if run.status in ENDED}
        self._sweep(lambda run, _: run in ended, report, partials=True)
        return report

    def delete_run(self, run_id: int) -> SweepReport:
        """Remove a run that is not running. First its status becomes `deleting` (never driven again, and a
        coordinator starting it now is refused), then its folder goes (so a run id SQLite hands out again cannot
        resume an old checkpoint), then its rows and audit events in one transaction (one `run-deleted` event
        stays), then its chunks, as orphans. A crash in between leaves a `deleting` run: delete it again.
        Raises RunRunning for a running run, ValueError for an unknown one."""
        run = self.store.run(run_id)
        if run.status == "running" or (not self.dry_run and not self._mark_deleting(run_id)):
            raise RunRunning(
                f"run {run_id} is running: a coordinator is driving it; delete it once it has ended"
            )
        report = SweepReport()
        folder = self.runs_dir / str(run_id)
        report.files, report.file_bytes = _tree_size(folder)
        doomed = [row.message_id for row in self._messages() if row.run_id == run_id]
        report.messages = len(doomed)
        report.replies = _count_replies(self.store, doomed)
        if self.dry_run:
            self._sweep_chunks(
                self._live(self._messages(), lambda run, _: run == run_id), report, partials=False
            )
            return report
        shutil.rmtree(folder, ignore_errors=True)
        with self.store.session() as session, session.begin():
            _delete_messages(session, doomed)
            session.execute(delete(AuditEvent).where(AuditEvent.run_id == run_id))
            session.execute(delete(Run).where(Run.id == run_id))
            detail = f"run {run_id} ({run.status}, {run.rounds_done} rounds) deleted with its folder and chunks"
            session.add(AuditEvent(kind="run-deleted", detail=detail))
        self._sweep_chunks(
            self._live(self._messages(), lambda run, server: False), report, partials=False
        )
        return report

    def _mark_deleting(self, run_id: int) -> bool:
        """Status `deleting` unless the run is running (checked in the same statement: race-free)."""
        with self.store.session() as session, session.begin():
            marked = session.execute(
                update(Run).where(Run.id == run_id, Run.status != "running").values(status=DELETING)
            )
            return cast(CursorResult, marked).rowcount == 1  # an UPDATE's result

    # --- the steps ---------------------------------------------------------------------------------------------

    def _prune_checkpoints(
        self, folder: Path, report: SweepReport, *, server_round: int | None = None
    ) -> None:
        if server_round is not None and not self.dry_run:
            archive_checkpoint(folder, server_round)
        for path in stale_checkpoints(folder, self.keep_checkpoints):
            report.files += 1
            report.file_bytes += path.stat().st_size
            if not self.dry_run:
                path.unlink(missing_ok=True)

    def _messages(self) -> list[OutboundMessage]:
        with self.store.session() as session:
            return list(session.scalars(select(OutboundMessage)))

    def _sweep(self, doomed: Doomed, report: SweepReport, *, partials: bool = False) -> None:
        """Rows first, then the chunks no row left refers to (see the module docstring for why this order)."""
        busy = (
            self._busy_sites()
        )  # before reading the rows: a site answering after this read is still spared
        messages = self._messages()
        gone = [row.message_id for row in messages if doomed(row.run_id, row.server_round)]
        report.messages += len(gone)
        report.replies += _count_replies(self.store, gone)
        if gone and not self.dry_run:
            with self.store.session() as session, session.begin():
                _delete_messages(session, gone)
        self._sweep_chunks(self._live(messages, doomed), report, partials=partials, busy=busy)

    def _live(self, messages: list[OutboundMessage], doomed: Doomed) -> dict[int | None, set[str]]:
        """Chunks the rows that stay refer to: the messages' at the root (None), each reply's in its site's
        namespace."""
        kept = [row for row in messages if not doomed(row.run_id, row.server_round)]
        live: dict[int | None, set[str]] = {None: set()}
        for row in kept:
            live[None].update(_chunks(row.envelope))
        for batch in _batches([row.message_id for row in kept]):
            for reply in self.store.replies_to(batch):
                live.setdefault(reply.node_id, set()).update(_chunks(reply.envelope))
        return live

    def _busy_sites(self) -> set[int]:
        return {node for node in self.blobs.namespaces() if self.store.open_messages_for(node)}

    def _sweep_chunks(
        self,
        live: dict[int | None, set[str]],
        report: SweepReport,
        *,
        partials: bool,
        busy: Iterable[int] = (),
    ) -> None:
        """Delete every chunk not in `live` (None: the root, else a site's namespace), but the busy sites' uploads
        and, beside a live coordinator, chunks younger than the grace."""
        spared = set(busy)
        namespaces: list[tuple[int | None, BlobStore | UploadPacks]] = [(None, self.blobs)]
        namespaces += [
            (node, self.blobs.uploads(node))
            for node in self.blobs.namespaces()
            if node not in spared
        ]
        horizon = time.time() - self.grace_s
        for key, blobs in namespaces:
            for digest in blobs.digests():
                if digest in live.get(key, set()):
                    continue
                try:
                    stat = blobs.stat(digest)
                except (FileNotFoundError, KeyError):
                    continue
                if stat.modified > horizon:
                    continue
                if not self.dry_run:
                    blobs.delete(digest)
                    _pause_for_tests(report.chunks == 0)
                report.chunks += 1
                report.chunk_bytes += stat.nbytes
            if partials:
                for path in blobs.partials():
                    if path.stat().st_mtime <= horizon and not self.dry_run:
                        path.unlink(missing_ok=True)


def was_swept(store: Store, message_id: str, node_id: int) -> bool:
    """Whether `message_id`, unknown now, names a message to `node_id` that a sweep deleted (a straggler's late
    reply to it is refused as late, not as someone else's). Reads the grid's ids, `run-round-type-node-seq`."""
    head, _, tail = message_id.partition("-")
    parts = tail.rsplit("-", 2)
    if len(parts) != 3 or not (
        head.isdigit() and parts[1].isdigit() and parts[0].split("-")[0].isdigit()
    ):
        return False
    run_id, server_round, node = int(head), int(parts[0].split("-")[0]), int(parts[1])
    if node != node_id:
        return False
    with store.session() as session:
        run = session.get(Run, run_id)
    return (
        run is None or run.status != "running" or 1 <= server_round <= run.rounds_done
    )  # None: a deleted run


def _chunks(envelope: bytes) -> list[str]:
    try:
        return chunk_hashes(pb.Envelope.FromString(envelope))
    except (
        EnvelopeError,
        DecodeError,
        ValueError,
    ) as error:  # unreadable: it refers to nothing a sweep could recognise
        log.warning(
            "a stored envelope cannot be parsed (%s); its chunks are treated as unreferenced", error
        )
        return []


def _count_replies(store: Store, message_ids: list[str]) -> int:
    with store.session() as session:
        return sum(
            session.scalar(
                select(func.count()).select_from(Reply).where(Reply.reply_to_message_id.in_(batch))
            )
            or 0
            for batch in _batches(message_ids)
        )


def _delete_messages(session: Session, message_ids: list[str]) -> None:
    """Replies first: they refer to their messages."""
    for batch in _batches(message_ids):
        session.execute(delete(Reply).where(Reply.reply_to_message_id.in_(batch)))
        session.execute(delete(OutboundMessage).where(OutboundMessage.message_id.in_(batch)))


def _batches(items: list[str]) -> list[list[str]]:
    return [items[start : start + BATCH] for start in range(0, len(items), BATCH)]


def _tree_size(folder: Path) -> tuple[int, int]:
    """Files and bytes under `folder`, each hard-linked file once."""
    seen: dict[tuple[int, int], int] = {}
    for path in folder.rglob("*") if folder.is_dir() else []:
        if path.is_file():
            stat = path.stat()
            seen[(stat.st_dev, stat.st_ino)] = stat.st_size
    return len(seen), sum(seen.values())


def _pause_for_tests(first: bool) -> None:
    pause_s = float(os.environ.get(SWEEP_PAUSE_ENV) or 0)
    if first and pause_s > 0:
        log.warning("sweep paused (%s=%g)", SWEEP_PAUSE_ENV, pause_s)
        time.sleep(pause_s)


@contextmanager
def _best_effort(what: str) -> Iterator[None]:
    """A sweep that fails (a disk or database error) is logged and retried by the next one; it never fails a run."""
    try:
        yield
    except (OSError, SQLAlchemyError) as error:
        log.warning("storage sweep after %s failed (%s); the next sweep retries", what, error)
