"""The asynchronous driver of a buffered strategy (FedBuff, `strategies.hooks.BuffersUpdates`): no rounds.

Every site is sent the newest model with its version; each reply is checked as the round driver checks one and
folded into the strategy's buffer with its staleness (the versions stepped since its message was sent, from the
driver's own record of what it sent, never from the reply); whenever the buffer is full the strategy steps, and
the site that just answered is at once sent the newest model. One step is one entry of the history (its `round`
is the model version it made), evaluated every `evaluate_every` steps and at the last, checkpointed like a round.
A model larger than `resident_model_bytes` stays on disk as the round driver keeps it: each update is folded into
the buffer's tensor file as it arrives and the step writes the next model file (`by_tensor.BuffersByTensor`).
Only the model's newest version is kept: the rule reads the updates (deltas) alone, and a message once pushed
has its own copy of the model it carries (the in-process grid answers it at once, the coordinator's blob store
holds its chunks while its version is open).

Two clocks deliver the replies. `VirtualClock` (simulation): the in-process grid answers a message as it is
sent, and its reply arrives 1 / speed virtual seconds later, in virtual-time order (ties in sending order), so
a run is deterministic, whatever the real timing. `WallClock` (a real grid, e.g. the coordinator's): messages
are pushed at once and replies pulled as sites store them.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from hydrafl import protocol
from hydrafl.arrays import keep_dtypes
from hydrafl.rounds import RoundRecord
from hydrafl.server.aggregation.driver import (
    DriverConfig,
    RoundCallback,
    RoundDriver,
    RoundFailed,
    RunResult,
)
from hydrafl.server.aggregation.evaluation import metric_value
from hydrafl.server.aggregation.traffic import count_down
from hydrafl.strategies.by_tensor import BuffersByTensor, RoundFiles, buffers_by_its_rule
from hydrafl.strategies.hooks import BuffersUpdates

log = logging.getLogger(__name__)

MAX_FAILURES = 3
"""A site whose replies failed this many times in a row is not sent more work."""


class VirtualClock:
    """Simulation: a message is answered when sent, and its reply delivered 1 / speed virtual seconds later."""

    def __init__(self, grid: Grid, speeds: Mapping[int, float]) -> None:
        self.grid = grid
        self.speeds = dict(speeds)
        self.now = 0.0
        self._queue: list[tuple[float, int, Message]] = []
        self._sent = 0

    def send(self, message: Message) -> str:
        [reply] = list(self.grid.send_and_receive([message]))
        arrival = self.now + 1.0 / self.speeds.get(message.metadata.dst_node_id, 1.0)
        heapq.heappush(self._queue, (arrival, self._sent, reply))
        self._sent += 1
        return message.metadata.message_id

    def receive(self, timeout_s: float | None) -> Message:
        """The earliest reply in virtual time (a simulated site always answers: no deadline)."""
        self.now, _, reply = heapq.heappop(self._queue)
        return reply

    @property
    def virtual_s(self) -> float | None:
        return self.now


class WallClock:
    """A real grid: messages are pushed at once, replies pulled as sites store them, polled every
    `poll_interval_s`."""

    virtual_s: float | None = None

    def __init__(self, grid: Grid, poll_interval_s: float = 0.05) -> None:
        self.grid = grid
        self.poll_interval_s = poll_interval_s
        self.pending: list[str] = []

    def send(self, message: Message) -> str:
        [message_id] = list(self.grid.push_messages([message]))
        self.pending.append(message_id)
        return message_id

    def receive(self, timeout_s: float | None) -> Message:
        """The next stored reply; TimeoutError when none came within `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while (reply := next(iter(self.grid.pull_messages(list(self.pending))), None)) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"no site answered within {timeout_s:g} s")
            time.sleep(self.poll_interval_s)
        self.pending.remove(reply.metadata.reply_to_message_id)
        return reply


Clock = VirtualClock | WallClock


def simulated_speeds(
    contexts: Mapping[int, Context], speeds: tuple[float, ...]
) -> dict[int, float]:
    """Each simulated site's relative speed: its partition's entry of the run's `site_speeds`, cycled (as
    `site_app.site_speed` reads it), its own node_config `speed` first; 1.0 when neither is set."""
    out = {}
    for node, context in contexts.items():
        index = int(context.node_config.get("partition-id", 0))
        default = speeds[index % len(speeds)] if speeds else 1.0
        out[node] = float(context.node_config.get("speed", default))
    return out


class AsyncDriver(RoundDriver):
    """Runs `config.num_rounds` buffer steps of a `BuffersUpdates` strategy over `grid`, replies from `clock`."""

    def __init__(
        self,
        grid: Grid,
        strategy: Strategy,
        config: DriverConfig,
        clock: Clock,
        *,
        evaluate_every: int = 1,
    ) -> None:
        if not isinstance(strategy, BuffersUpdates):
            raise TypeError(
                f"{type(strategy).__name__} has no buffer: the asynchronous driver needs a BuffersUpdates strategy"
            )
        super().__init__(grid, strategy, config)
        self.buffer: BuffersUpdates = strategy
        """The strategy, as the buffer it is."""
        self.clock = clock
        self.evaluate_every = evaluate_every
        self.sent: dict[str, tuple[int, int]] = {}
        """Message id -> (node, model version it carried), for every message in flight."""
        self.failures: Counter[int] = Counter()
        self.local_rounds: Counter[int] = Counter()

    def _on_disk_refusal(self, arrays: ArrayRecord) -> str:
        """Why this strategy cannot buffer a model kept on disk ("" when it can): a strategy that does buffers
        each update into a file as it arrives (`by_tensor.BuffersByTensor`)."""
        if buffers_by_its_rule(self.strategy):
            return ""
        return (
            f"strategy {type(self.strategy).__name__} folds its buffer's updates in memory (FedBuff and "
            "FedBuff over Hydra-nets buffer on disk); raise resident-model-mb above the model if this "
            "coordinator can hold it"
        )

    def _files(self, version: int) -> RoundFiles:
        """Where the buffer that makes model `version + 1` writes its files (a model kept on disk)."""
        assert self.config.run_dir is not None  # kept on disk only with a run folder
        return RoundFiles(self.config.run_dir, version + 1)

    def run(
        self,
        start: Callable[[], ArrayRecord],
        *,
        resume: bool = False,
        on_round: RoundCallback | None = None,
    ) -> RunResult:
        """`start` gives the initial arrays; it is called only when there is no checkpoint to resume from, so a
        restarted coordinator asks no site for a model (or a curvature probe) it already has."""
        history, version = [], 0
        checkpoint = self._resume() if resume else None
        if checkpoint is not None:
            arrays, history, version = (
                checkpoint.arrays,
                checkpoint.history,
                checkpoint.server_round,
            )
            log.info("resuming after model version %d", version)
            arrays = self._placed(arrays, version)
        else:
            arrays = self._placed(start(), 0)
            self._close(self.evaluation.run(0, arrays), history, arrays, on_round)
        if version >= self.config.num_rounds:
            return RunResult(arrays=arrays, history=history)
        record, started = RoundRecord(round=version + 1), time.perf_counter()
        self._query_round(version + 1, arrays, ConfigRecord(dict(self.config.train_config)), record)
        for node in sorted(self.grid.get_node_ids()):
            self._dispatch(node, arrays, version, record)
        while version < self.config.num_rounds:
            reply = self._next_reply(version)
            node, sent_version = self.sent.pop(reply.metadata.reply_to_message_id)
            valid = next(self.intake.valid(version + 1, [reply], arrays, record), None)
            if valid is None:
                self.failures[node] += 1
                record.sites_failed += 1
            else:
                self.failures[node] = 0
                self._add(valid, version - sent_version, arrays, version)
            if self.buffer.buffer_full:
                arrays, version = self._step(arrays, version, record, started), version + 1
                self._close(record, history, arrays, on_round)
                record, started = RoundRecord(round=version + 1), time.perf_counter()
            if version < self.config.num_rounds and self.failures[node] < MAX_FAILURES:
                self._dispatch(node, arrays, version, record)
        return RunResult(arrays=arrays, history=history)

    def _add(self, reply: Message, staleness: int, arrays: ArrayRecord, version: int) -> None:
        """Fold `reply` into the buffer: in memory, or, the model kept on disk, into the buffer's file."""
        if not self.on_disk:
            self.buffer.add(reply, staleness)
            return
        assert isinstance(self.strategy, BuffersByTensor)  # `_on_disk_refusal` let it through
        self.strategy.add_on_disk(reply, staleness, arrays, self._files(version))

    def _dispatch(self, node: int, arrays: ArrayRecord, version: int, record: RoundRecord) -> None:
        """Send `node` the model of `version` (the site's own local round count as its round, so its batches
        move on)."""
        self.local_rounds[node] += 1
        config = ConfigRecord(
            {
                **self.config.train_config,
                protocol.SERVER_ROUND: self.local_rounds[node],
                protocol.MODEL_VERSION: version,
            }
        )
        message = self.buffer.train_message(node, arrays, config)
        if message is None:
            return
        message.metadata.group_id = str(
            version
        )  # the coordinator keeps a version's messages while one is open
        count_down([message], record)
        self.sent[self.clock.send(message)] = (node, version)

    def _next_reply(self, version: int) -> Message:
        """The next reply; RoundFailed when too few sites are still at work or none answered in time."""
        working = {node for node, _ in self.sent.values()}
        if len(working) < max(self.config.required_sites, 1):
            raise RoundFailed(
                f"step {version + 1}: only {len(working)} sites are still training, {self.config.required_sites} "
                f"required (min_sites); the run stops with model version {version} saved"
            )
        try:
            return self.clock.receive(self.config.timeout_s)
        except TimeoutError as error:
            raise RoundFailed(
                f"step {version + 1}: {error}; the run stops with model version {version} saved"
            ) from None

    def _step(
        self, arrays: ArrayRecord, version: int, record: RoundRecord, started: float
    ) -> ArrayRecord:
        """The buffer's step into model `version + 1`, evaluated when due; `record` filled in."""
        stepped = time.perf_counter()
        if self.on_disk:
            assert isinstance(self.strategy, BuffersByTensor)
            new_arrays, metrics, report = self.strategy.step_on_disk(arrays, self._files(version))
        else:
            new_arrays, metrics, report = self.buffer.step(arrays)
        record.aggregation_s = time.perf_counter() - stepped
        new_arrays = keep_dtypes(new_arrays, arrays)
        if report.skipped:
            log.warning(
                "step %d: buffer skipped, ESS %.2f below ess-min (nodes %s)",
                version + 1,
                report.ess,
                report.nodes,
            )
        record.staleness, record.update_weights = list(report.staleness), list(report.weights)
        record.ess, record.virtual_s = report.ess, self.clock.virtual_s
        record.train_loss = metric_value(metrics, "train_loss")
        if (version + 1) % self.evaluate_every == 0 or version + 1 == self.config.num_rounds:
            evaluation = self.evaluation.run(version + 1, new_arrays)
            record.loss, record.accuracy = evaluation.loss, evaluation.accuracy
            record.bytes_down += evaluation.bytes_down
            record.bytes_up += evaluation.bytes_up
        record.seconds = time.perf_counter() - started
        record.oldest_open = min((sent for _, sent in self.sent.values()), default=version + 1)
        return new_arrays
