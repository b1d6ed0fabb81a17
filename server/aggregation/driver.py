"""The round driver: Flower's strategy hooks, called unchanged, plus what `Strategy.start` lacks.

A training round is a pipeline of small steps, each in its own module of this package:

    receive (`exchange`) -> decode and check (`reply_intake`, `reply_check`) -> screen (`screening`)
    -> collect -> aggregate (`flower_adapter`) -> record (`run_log`, `checkpoint`)

Replies are checked as they arrive, before aggregation; a hydrafl strategy aggregates each valid reply before
the next arrives (a streamed round: the server holds one reply plus the strategy's running sums, however many
sites), while screening, the diagnostics (`diagnostics`) and Flower's own aggregation collect the round's
replies in node order first. The round is deterministic (seeded sampling; collected replies in node order). A
minimum-success rule (`quorum`) fails the run loudly, checked once the replies are all in (a failed round's
model is discarded). Each round ends with an evaluation (`evaluation`), a checkpoint of the global arrays and
the strategy's state (resume ends with the same numbers) and a timing/bytes log whose schema (`rounds.tsv`)
every runtime shares. Secure aggregation (`secure_round`) replaces the receive, decode and check steps with
one summed reply; the privacy ledger (`hydrafl.privacy.ledger`) accounts each round's spending.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy

from hydrafl.arrays import keep_dtypes, record_nbytes
from hydrafl.compression.downloads import DownloadCompression
from hydrafl.compression.layout import Scheme
from hydrafl.privacy.ledger import PrivacyLedger
from hydrafl.rounds import RoundRecord
from hydrafl.secagg import SecAggError, SecAggParams
from hydrafl.server.aggregation.checkpoint import Checkpoint, resume_checkpoint
from hydrafl.server.aggregation.diagnostics import RoundDiagnostics
from hydrafl.server.aggregation.evaluation import Evaluation, metric_value
from hydrafl.server.aggregation.exchange import Exchange
from hydrafl.server.aggregation.flower_adapter import FlowerAdapter
from hydrafl.server.aggregation.quorum import RoundFailed, require_sites
from hydrafl.server.aggregation.rejections import Rejections
from hydrafl.server.aggregation.reply_check import ReplyCheck
from hydrafl.server.aggregation.reply_intake import ReplyIntake
from hydrafl.server.aggregation.run_log import RunLog
from hydrafl.server.aggregation.screening import Screening, screen_replies
from hydrafl.server.aggregation.secure_round import SecureRound
from hydrafl.server.aggregation.traffic import count_down, count_up
from hydrafl.strategies import hooks
from hydrafl.strategies.by_tensor import MODEL, RoundFiles
from hydrafl.tensor_files import MappedArray, as_record, layout_of

__all__ = ["DriverConfig", "RoundCallback", "RoundDriver", "RoundFailed", "RunResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverConfig:
    num_rounds: int
    required_sites: int
    """A training round with fewer valid replies fails the run."""
    seed: int = 0
    timeout_s: float | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    """Keys every train message carries besides the strategy's: the form its reply must take (the compression
    scheme, which the coordinator's edge holds a reply to); the run's other settings reach a site once per run,
    in its Context (`hydrafl.run_settings`)."""
    evaluate_config: dict[str, Any] = field(default_factory=dict)
    run_dir: Path | None = None
    """Checkpoints, history.json and rounds.tsv go here; None keeps the run in memory only."""
    run_config: dict[str, Any] = field(default_factory=dict)
    """Saved with checkpoints; a resume with a different configuration is refused."""
    run_config_defaults: dict[str, Any] = field(default_factory=dict)
    """Each run config key's default. A key a checkpoint lacks was added by a later hydrafl; a resume that
    leaves it at its default goes on (a coordinator upgraded mid-run keeps its runs), with a warning."""
    diagnostics: bool = False
    """Compute B_pg over each round's deltas (and the full-data cosine when `reference_node` is set)."""
    reference_node: int | None = None
    """A node outside the sampled sites that trains on all sites' pooled data (the simulation grid's)."""
    secagg: SecAggParams | None = None
    """Secure aggregation: train rounds learn only the sites' summed update and weight (`secure_round`)."""
    screening: Screening = field(default_factory=Screening)
    """Reject outlying updates before aggregation (`screening`); on, it holds each round's replies."""
    resident_model_bytes: int | None = None
    """A global model larger than this is kept on disk, in `run_dir`, and aggregated tensor by tensor
    (`strategies.by_tensor`); None keeps every model in memory."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RunResult:
    arrays: ArrayRecord
    history: list[dict[str, Any]]


RoundCallback = Callable[[RoundRecord], None]


class RoundDriver:
    """Runs `config.num_rounds` rounds of `strategy` over `grid`; sites reply with deltas (start - end)."""

    def __init__(self, grid: Grid, strategy: Strategy, config: DriverConfig) -> None:
        self.grid = grid
        self.strategy = strategy
        self.config = config
        self.adapter = FlowerAdapter(strategy)
        self.privacy = PrivacyLedger.from_run_config(config.run_config, config.secagg)
        self.exchange = Exchange(
            grid, DownloadCompression.from_config(config.run_config), config.timeout_s
        )
        scheme = Scheme.from_config(config.run_config)  # how sites compress their updates
        check = ReplyCheck(strategy, self.adapter.weighted_by_key)
        self.rejections = Rejections(grid)
        self.intake = ReplyIntake(scheme, check, self.rejections, self.privacy)
        self.diagnostics = RoundDiagnostics(
            self.exchange, scheme, self.adapter.weighted_by_key, config.reference_node
        )
        self.evaluation = Evaluation(
            self.adapter,
            self.exchange,
            check,
            evaluate_config=config.evaluate_config,
            final_round=config.num_rounds,
            secagg=config.secagg,
        )
        self.run_log = RunLog(config.run_dir, strategy, config.run_config)
        self.on_disk = False
        """The global model lives in the run folder and rounds aggregate tensor by tensor (`_placed`)."""

    def run(
        self,
        start: Callable[[], ArrayRecord],
        *,
        resume: bool = False,
        on_round: RoundCallback | None = None,
    ) -> RunResult:
        """`start` gives the initial arrays; it is called only when there is no checkpoint to resume from, so a
        restarted coordinator asks no site for a model (or a curvature probe) it already has."""
        history: list[dict[str, Any]] = []
        checkpoint = self._resume() if resume else None
        if checkpoint is not None:
            arrays, history = checkpoint.arrays, checkpoint.history
            arrays = self._placed(arrays, checkpoint.server_round)
            self.privacy.restore(history)
            log.info("resuming after round %d", checkpoint.server_round)
        else:
            arrays = self._placed(start(), 0)
            self._close(self.evaluation.run(0, arrays), history, arrays, on_round)
        first_round = 1 if checkpoint is None else checkpoint.server_round + 1
        last_end = time.perf_counter()
        for server_round in range(first_round, self.config.num_rounds + 1):
            started = time.perf_counter()
            arrays, record = self._train_round(server_round, arrays)
            evaluation = self.evaluation.run(server_round, arrays)
            record.loss, record.accuracy = evaluation.loss, evaluation.accuracy
            record.bytes_down += evaluation.bytes_down
            record.bytes_up += evaluation.bytes_up
            record.secagg_bytes += evaluation.secagg_bytes
            record.secagg_s += evaluation.secagg_s
            record.gap_s = started - last_end if server_round > first_round else 0.0
            last_end = time.perf_counter()
            record.seconds = last_end - started
            self._close(record, history, arrays, on_round)
        return RunResult(arrays=arrays, history=history)

    def _train_round(
        self, server_round: int, arrays: ArrayRecord
    ) -> tuple[ArrayRecord, RoundRecord]:
        """receive -> decode -> check -> screen -> collect -> aggregate; the caller records the round."""
        random.seed(self.config.seed * 100_003 + server_round)  # Flower samples nodes with `random`
        config = ConfigRecord(dict(self.config.train_config))
        record = RoundRecord(round=server_round)
        self._query_round(server_round, arrays, config, record)
        messages = list(self.strategy.configure_train(server_round, arrays, config, self.grid))
        sites_available = len(list(self.grid.get_node_ids()))
        self.privacy.open_round(messages, sites_available, self.strategy, arrays)
        replies = self._receive(server_round, messages, arrays, record)
        replies = self._screen(server_round, replies, record)
        replies = self._collect(server_round, messages, replies, record)
        new_arrays, metrics = self._aggregate(server_round, len(messages), replies, arrays, record)
        self.privacy.close_round(record)
        record.train_loss = metric_value(metrics, "train_loss")
        return new_arrays, record

    def _query_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, record: RoundRecord
    ) -> None:
        """The strategy's questions before training (a planning round, `hooks.QueriesSites`), exchanged like
        the round's own messages: same deadline and group id, their bytes counted in the round's."""
        strategy = self.strategy
        if not isinstance(strategy, hooks.QueriesSites):
            return
        queries = list(strategy.configure_query(server_round, arrays, config, self.grid))
        if not queries:
            return
        count_down(queries, record)
        replies = sorted(self.exchange(queries, server_round), key=_node)
        for reply in replies:
            if not reply.has_error():
                count_up(reply, record)
        strategy.aggregate_query(server_round, replies)

    def _receive(
        self,
        server_round: int,
        messages: Sequence[Message],
        arrays: ArrayRecord,
        record: RoundRecord,
    ) -> Iterable[Message]:
        """The round's valid replies, decoded and checked as they arrive; under secure aggregation the one
        reply holding the survivors' summed update."""
        wire = self.exchange.outgoing(messages, server_round, record)
        if self.config.secagg is None:
            return self.intake.valid(
                server_round, self.exchange(wire, server_round), arrays, record
            )
        files = None
        if self.on_disk:  # the masked sum and the decoded mean go to files of the round's
            assert self.config.run_dir is not None  # `_placed` put the model there
            files = RoundFiles(self.config.run_dir, server_round)
        secure = SecureRound(
            self.exchange, self.config.secagg, self.adapter.weighted_by_key, self.strategy, files
        )
        try:
            return [secure.train(server_round, messages, arrays, record)]
        except SecAggError as error:
            raise RoundFailed(f"round {server_round}: secure aggregation: {error}") from None

    def _screen(
        self, server_round: int, replies: Iterable[Message], record: RoundRecord
    ) -> Iterable[Message]:
        """With screening on, the round's replies less the outliers (`screening`), each one rejected."""
        if not self.config.screening.enabled:
            return replies
        kept, rejected = screen_replies(self.config.screening, replies)
        for node, reason in rejected.items():
            self.rejections.reject(server_round, node, reason, record)
        record.sites_ok -= len(rejected)
        return kept

    def _collect(
        self,
        server_round: int,
        messages: Sequence[Message],
        replies: Iterable[Message],
        record: RoundRecord,
    ) -> Iterable[Message]:
        """All replies at once, in node order (any grid: the same sums), for what needs every reply together:
        Flower's aggregation (a matching majority) and the diagnostics' two passes; else the stream as it is.
        A secure round has one reply."""
        if self.config.secagg is not None or not (
            self.adapter.matches_train or self.config.diagnostics
        ):
            return replies
        collected = self.adapter.matching(server_round, sorted(replies, key=_node), train=True)
        if self.adapter.matches_train:
            record.sites_ok = len(collected)
        require_sites(server_round, len(messages), self.config.required_sites, record)
        if self.config.diagnostics:
            self.diagnostics.measure(server_round, messages, collected, record)
        return collected

    def _aggregate(
        self,
        server_round: int,
        sent: int,
        replies: Iterable[Message],
        arrays: ArrayRecord,
        record: RoundRecord,
    ) -> tuple[ArrayRecord, MetricRecord | None]:
        """The strategy's new model, in the global model's dtypes; its seconds, less the wait for replies, in
        `record`. Replies the strategy did not ask for still count toward the minimum-success rule, which is
        the failure to report when too few sites answered."""
        waited = _Waited()
        started = time.perf_counter()
        summed = self.config.secagg is not None
        try:
            if self.on_disk:
                assert self.config.run_dir is not None  # `_placed` put the model there
                files = RoundFiles(self.config.run_dir, server_round)
                # their tensors are still on disk; in node order, so the sums are the same whatever the
                # order the sites answered in
                stored = sorted(_timed(replies, waited), key=_node)
                new_arrays, metrics = self.adapter.aggregate_by_tensor(
                    server_round, stored, arrays, files, summed=summed
                )
            else:
                new_arrays, metrics = self.adapter.aggregate_train(
                    server_round, _timed(replies, waited), arrays, summed=summed
                )
        except Exception:
            deque(replies, maxlen=0)
            require_sites(server_round, sent, self.config.required_sites, record)
            raise
        record.aggregation_s = time.perf_counter() - started - waited.seconds
        deque(replies, maxlen=0)
        require_sites(server_round, sent, self.config.required_sites, record)
        if new_arrays is None:
            raise RoundFailed(
                f"round {server_round}: the strategy produced no model from {record.sites_ok} replies"
            )
        return keep_dtypes(new_arrays, arrays), metrics

    def _placed(self, arrays: ArrayRecord, server_round: int) -> ArrayRecord:
        """`arrays` where the run keeps its model: in memory, or, larger than `resident_model_bytes` (and with a
        run folder), in a tensor file of the run folder, written a tensor at a time. Refuses, before any round,
        what cannot aggregate a model on disk."""
        if not kept_on_disk(self.config, arrays, lambda: self._on_disk_refusal(arrays)):
            return arrays
        folder = self.config.run_dir
        assert folder is not None  # kept on disk only with a run folder
        self.on_disk = True
        if all(
            isinstance(a, MappedArray) and Path(a.path).parent == folder for a in arrays.values()
        ):
            return arrays  # a resumed checkpoint's model file
        model = RoundFiles(folder, server_round).writer(MODEL, layout_of(arrays))
        for name, array in arrays.items():
            model.write(name, array)
        return as_record(model.close())

    def _on_disk_refusal(self, arrays: ArrayRecord) -> str:
        """Why this run cannot keep its model on disk ("" when it can)."""
        if self.config.screening.enabled or self.config.diagnostics:
            return "screening and diagnostics compare whole replies in memory"
        return self.adapter.by_tensor_refusal(arrays, summed=self.config.secagg is not None)

    def _resume(self) -> Checkpoint | None:
        """The checkpoint to go on from (its configuration checked), the strategy's state restored from it."""
        checkpoint = resume_checkpoint(
            self.config.run_dir, self.config.run_config, self.config.run_config_defaults
        )
        if checkpoint is not None:
            hooks.restore_strategy_state(self.strategy, checkpoint.strategy_state)
        return checkpoint

    def _close(
        self,
        record: RoundRecord,
        history: list[dict[str, Any]],
        arrays: ArrayRecord,
        on_round: RoundCallback | None,
    ) -> None:
        """The record step: the round joins the history, the log and the run directory, then `on_round`."""
        history.append(asdict(record))
        self.run_log.write(record, history, arrays)
        if on_round:
            on_round(record)


def kept_on_disk(config: DriverConfig, arrays: ArrayRecord, refusal: Callable[[], str]) -> bool:
    """Whether a run of `config` keeps `arrays` on disk: larger than `resident_model_bytes`, with a run folder.
    RoundFailed, before any round, when `refusal()` says why this run cannot ("" when it can)."""
    limit = config.resident_model_bytes
    if limit is None or config.run_dir is None:
        return False
    nbytes = record_nbytes(arrays)
    if nbytes <= limit:
        return False
    if reason := refusal():
        raise RoundFailed(
            f"the global model ({nbytes / 2**20:.0f} MiB) is larger than the coordinator keeps in memory "
            f"(resident-model-mb), and {reason}"
        )
    return True


def _node(reply: Message) -> int:
    return reply.metadata.src_node_id


@dataclass(slots=True)
class _Waited:
    """Seconds spent waiting for replies (sites, transfer, checks) while the strategy aggregates a stream: not
    aggregation time."""

    seconds: float = 0.0


def _timed(replies: Iterable[Message], waited: _Waited) -> Iterator[Message]:
    """`replies`, adding the time taken to produce each one to `waited`."""
    started = time.perf_counter()
    for reply in replies:
        waited.seconds += time.perf_counter() - started
        yield reply
        started = time.perf_counter()
    waited.seconds += time.perf_counter() - started
