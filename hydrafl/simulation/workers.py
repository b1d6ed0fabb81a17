"""Worker processes for the in-process grid: sites answer in parallel, and the server sees what it would see
had they answered one after another.

Processes, not threads: hydrafl's ClientApp keeps one working model per process (threads would train each
other's weights), and a small model's forward pass holds the GIL most of the time. Workers are forked from the
grid's process, so they start with its imports, its cached cohorts and the ClientApp as it is (any app, no
pickling). Each job carries the site's Context in Flower's protobuf form and its result carries the Context's
state back, so the grid's contexts stay the one record of every site's state and any worker can answer any
site; a worker that dies costs only the message it held. `WorkerPool.run` hands results back in the order
the jobs were given (the grid gives them in node order), so the server aggregates replies in the order of the
sequential grid: the same floating-point sums, bit for bit. Log records a site emits travel with its result
and are emitted here, in that order too. What an app changes outside its Context (module globals) stays in
its worker, as on a real site's own machine.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from flwr.app import Context, Message
from flwr.common.serde import (
    context_from_proto,
    context_to_proto,
    message_from_proto,
    message_to_proto,
    recorddict_from_proto,
    recorddict_to_proto,
)
from flwr.proto.message_pb2 import Context as ProtoContext  # pylint: disable=no-name-in-module
from flwr.proto.message_pb2 import Message as ProtoMessage  # pylint: disable=no-name-in-module
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module

log = logging.getLogger(__name__)

Serve = Callable[[Message, Context], Message]
"""What a worker runs for one job: the site's reply to a message, given the site's Context (which it may change)."""


@dataclass(frozen=True, slots=True)
class Job:
    """One message for one site, serialised: the message as the site receives it and the site's Context."""

    message: bytes
    context: bytes


@dataclass(frozen=True, slots=True)
class Result:
    """A job's outcome: the serialised reply and the site's state after it, or why the worker died
    (`crash`, with no reply and the state unchanged)."""

    reply: bytes = b""
    state: bytes = b""
    crash: str = ""
    logs: list[dict[str, Any]] = field(default_factory=list)

    def reply_message(self) -> Message:
        return message_from_proto(ProtoMessage.FromString(self.reply))

    def apply_state(self, context: Context) -> None:
        """Store the site's state as the job left it in the grid's Context of that site."""
        context.state = recorddict_from_proto(ProtoRecordDict.FromString(self.state))


def make_job(message: Message, context: Context) -> Job:
    return Job(
        message_to_proto(message).SerializeToString(), context_to_proto(context).SerializeToString()
    )


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform tells it)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def worker_count(requested: int, sites: int) -> int:
    """The workers a grid of `sites` runs: `requested`, or with 0 one per core (never more than sites); 1 where
    the platform cannot fork (the workers inherit the app by forking)."""
    if requested < 0:
        raise ValueError(f"workers must be >= 0 (0: one per core), got {requested}")
    count = min(requested or available_cores(), sites) if requested != 1 else 1
    if count > 1 and "fork" not in multiprocessing.get_all_start_methods():
        log.warning(
            "this platform cannot fork worker processes; the %d sites run one after another", sites
        )
        return 1
    return count


@dataclass(slots=True)
class _Worker:
    process: BaseProcess
    conn: Connection
    sent: deque[tuple[int, Job]] = field(default_factory=deque)
    """The jobs sent to it and not yet answered (index, job), the one it is answering first."""


class WorkerPool:
    """`size` forked worker processes that each run `serve` on the jobs they are sent. Create the pool once the
    state the workers should inherit (the ClientApp, cached data) exists; `close` ends them (so does the
    pool's garbage collection, and the exit of this process). Each worker is sent up to `DEPTH` jobs at a time,
    so it starts the next one as soon as it has sent a result, without waiting for this process to be scheduled
    (on a busy machine that wait, not the sites, would set the pace)."""

    DEPTH = 2

    def __init__(self, size: int, serve: Serve) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self._serve = serve
        self._threads = _torch_threads()
        self._context = multiprocessing.get_context("fork")
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop, self._workers)
        for _ in range(size):
            self._workers.append(self._start())

    def _start(self) -> _Worker:
        sys.stdout.flush()
        sys.stderr.flush()  # buffered output is written once, here, not again by each child at its exit
        parent_end, child_end = self._context.Pipe()
        inherited = [parent_end, *(worker.conn for worker in self._workers)]
        process = self._context.Process(
            target=_work,
            args=(child_end, inherited, self._serve, self._threads),
            daemon=True,
            name="hydrafl-site-worker",
        )
        process.start()
        child_end.close()
        return _Worker(process, parent_end)

    @property
    def size(self) -> int:
        return len(self._workers)

    def run(
        self, jobs: Iterable[Job | None], *, window: int | None = None
    ) -> Iterator[Result | None]:
        """Each job's result, in the jobs' order, as soon as it and every earlier one are done (None for a None
        job: a message with no site to run). At most `window` jobs (default twice those the workers can hold)
        are taken ahead of the result being waited for, so memory stays bounded by the window, not by the
        number of jobs."""
        window = window or 2 * self.DEPTH * self.size
        try:
            yield from self._in_order(iter(jobs), window)
        finally:  # a caller that stops early: the workers' unread results must not answer a later run's jobs
            while any(worker.sent for worker in self._workers):
                self._collect(deque())

    def _in_order(self, pending: Iterator[Job | None], window: int) -> Iterator[Result | None]:
        done: dict[int, Result | None] = {}
        queued: deque[tuple[int, Job]] = deque()
        next_index = next_result = 0
        exhausted = False
        while True:
            while not exhausted and next_index - next_result < window:
                try:
                    job = next(pending)
                except StopIteration:
                    exhausted = True
                    break
                if job is None:
                    done[next_index] = None
                else:
                    queued.append((next_index, job))
                next_index += 1
            done.update(
                self._collect(queued, timeout=0)
            )  # workers already done take more jobs before we yield
            self._dispatch(queued)
            if next_result in done:
                yield done.pop(next_result)
                next_result += 1
                continue
            if exhausted and next_result == next_index:
                return
            done.update(self._collect(queued))

    def _dispatch(self, queued: deque[tuple[int, Job]]) -> None:
        """Send queued jobs, in order, each to the worker holding the fewest, up to `DEPTH` each."""
        while queued:
            worker = min(self._workers, key=lambda w: len(w.sent))
            if len(worker.sent) >= self.DEPTH:
                return
            worker.sent.append(queued.popleft())
            try:
                worker.conn.send(worker.sent[-1][1])
            except (
                BrokenPipeError,
                ConnectionResetError,
            ):  # it died: `_collect` finds it and re-queues the job
                return

    def _collect(
        self, queued: deque[tuple[int, Job]], timeout: float | None = None
    ) -> dict[int, Result]:
        """Wait (at most `timeout` seconds; None: until a worker with jobs has answered one or died) and take
        the results there are, by job index. A dead worker's current job gets a crash result, the jobs it had
        not started go back to the front of `queued`, and a fresh worker takes its place."""
        busy = [worker for worker in self._workers if worker.sent]
        ready = set(wait([w.conn for w in busy] + [w.process.sentinel for w in busy], timeout))
        results: dict[int, Result] = {}
        for position, worker in enumerate(self._workers):
            dead = worker.process.sentinel in ready or not worker.process.is_alive()
            while worker.sent and (dead or worker.conn in ready) and worker.conn.poll():
                try:
                    results[worker.sent[0][0]] = worker.conn.recv()
                except (EOFError, ConnectionResetError):
                    break
                worker.sent.popleft()
            if dead:
                worker.process.join()
                if worker.sent:
                    results[worker.sent.popleft()[0]] = Result(
                        crash=_death(worker.process.exitcode)
                    )
                queued.extendleft(reversed(worker.sent))
                worker.conn.close()
                self._workers[position] = self._start()
        return results

    def close(self) -> None:
        """End the workers (idempotent)."""
        self._finalizer()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop(workers: list[_Worker]) -> None:
    for worker in workers:
        worker.conn.close()  # an idle worker reads end-of-file and exits
        if worker.sent:  # a busy one's answer has no reader any more
            worker.process.kill()
    for worker in workers:
        worker.process.join(timeout=5)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
    workers.clear()


def _death(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return (
            f"its worker process was killed by {signal.Signals(-exitcode).name} while it answered"
        )
    return f"its worker process exited with code {exitcode} while it answered"


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _work(conn: Connection, inherited: list[Connection], serve: Serve, threads: int | None) -> None:
    """A worker's life: answer jobs until the pool closes its end of the pipe. `inherited`: the pool's ends of
    the pipes, its own and the other workers', which this copy must not keep open (a worker sees the end of
    its pipe only once every copy of the pool's end is closed)."""
    for end in inherited:
        end.close()
    signal.signal(
        signal.SIGINT, signal.SIG_IGN
    )  # Ctrl-C is the pool's process's to handle; it ends the workers
    forwarded = _forward_logs()
    if threads is not None:
        sys.modules["torch"].set_num_threads(
            threads
        )  # the parent's count: the same kernels, the same sums
    inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
    threading.Thread(target=_read_jobs, args=(conn, inbox), daemon=True).start()
    while (job := inbox.get()) is not None:
        message = message_from_proto(ProtoMessage.FromString(job.message))
        context = context_from_proto(ProtoContext.FromString(job.context))
        reply = serve(message, context)
        result = Result(
            reply=message_to_proto(reply).SerializeToString(),
            state=recorddict_to_proto(context.state).SerializeToString(),
            logs=forwarded.drain(),
        )
        try:
            conn.send(result)
        except BrokenPipeError:  # the pool closed while this site ran
            return


def _read_jobs(conn: Connection, inbox: queue.SimpleQueue[Job | None]) -> None:
    """Take jobs off the pipe as soon as they come, even while a result is being written: the pool may be
    writing the next job (larger than the pipe's buffer) while this worker writes its result, and neither
    would ever finish if both waited for the other to read. None: the pool closed its end."""
    while True:
        try:
            inbox.put(conn.recv())
        except (EOFError, OSError):
            inbox.put(None)
            return


_RECORD_FIELDS = (
    "name",
    "levelno",
    "levelname",
    "pathname",
    "filename",
    "module",
    "lineno",
    "funcName",
    "created",
    "msecs",
    "relativeCreated",
    "process",
    "processName",
    "exc_text",
    "stack_info",
)


class _Forward(logging.Handler):
    """Keeps a worker's log records for its next result; the pool's process emits them through its own handlers."""

    def __init__(self) -> None:
        super().__init__(level=logging.NOTSET)
        self.records: list[dict[str, Any]] = []

    def emit(self, record: logging.LogRecord) -> None:
        entry = {
            key: getattr(record, key) for key in _RECORD_FIELDS
        }  # not `extra`s, which may not pickle
        entry["msg"] = record.getMessage()
        if record.exc_info:
            entry["exc_text"] = logging.Formatter().formatException(record.exc_info)
        self.records.append(entry)

    def drain(self) -> list[dict[str, Any]]:
        records, self.records = self.records, []
        return records


def _forward_logs() -> _Forward:
    """In a fresh worker: every logger's handlers become one forwarder, and stdout and stderr new file objects
    on the same descriptors, so nothing in the worker waits on a lock another thread of its parent held when
    it forked (a progress bar's console, a stream's buffer)."""
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    forward = _Forward()
    loggers = [
        logging.getLogger(),
        *(lg for lg in logging.root.manager.loggerDict.values() if isinstance(lg, logging.Logger)),
    ]
    for logger in loggers:
        if logger.handlers or logger is logging.root:
            logger.handlers = [forward]
    return forward


def emit_logs(records: list[dict[str, Any]]) -> None:
    """Emit a worker's forwarded records here, through the handlers of the loggers that made them."""
    for entry in records:
        record = logging.makeLogRecord(entry)
        logging.getLogger(record.name).handle(record)
