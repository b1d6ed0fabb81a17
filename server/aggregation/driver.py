"""The round driver: Flower's strategy hooks, called unchanged, plus what `Strategy.start` lacks.

Added here: a deterministic round (seeded sampling, replies in node order), decoding of compressed replies
(`--compress`; bytes are counted as sent), compressed downloads (`--compress-downloads`), validation of every
reply as it arrives, before aggregation, a streamed round (a hydrafl strategy aggregates each valid reply before
the next arrives, so the server holds one reply plus the strategy's running sums, however many sites; Flower's
own strategies and the diagnostics get them all in a list), a minimum-success rule that fails the run loudly
(checked once the replies are all in; a failed round's model is discarded), per-round checkpoints of the global
arrays and the strategy's state (resume ends with the same numbers), and a timing/bytes log whose schema
(`rounds.tsv`) every runtime shares. Each round's record keeps every site's data hash (the `data-hash` each
train reply carries), and with `diagnostics` the sites' pseudo-gradient noise scale B_pg and, when the grid
has a full-data reference site, the cosine between the averaged delta and that site's delta.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, Strategy

from hydrafl import protocol
from hydrafl.arrays import array_view, keep_dtypes, record_nbytes, weights_from_delta
from hydrafl.compression.downloads import DownloadCompression
from hydrafl.compression.layout import CompressionError, Scheme
from hydrafl.compression.receive import decode_reply
from hydrafl.privacy.ledger import PrivacyLedger
from hydrafl.rounds import ROUNDS_TSV_COLUMNS, RoundRecord, metric
from hydrafl.secagg import SecAggError, SecAggParams
from hydrafl.server.aggregation.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_checkpoint,
    save_checkpoint,
)
from hydrafl.server.aggregation.pseudo_gradients import (
    DeltaMoments,
    ZeroDeltaError,
    cosine_to_reference,
)
from hydrafl.server.aggregation.screening import AuditsRejections, Screening, screen_replies
from hydrafl.server.aggregation.secure_round import SecureRound
from hydrafl.strategies import hooks
from hydrafl.updates import (
    InvalidUpdate,
    array_names,
    check_evaluate_reply,
    check_train_reply,
    consistent_majority,
    metric_layout,
    records,
)

log = logging.getLogger(__name__)


class RoundFailed(RuntimeError):
    """Too few sites answered a round without error; the run stops instead of silently keeping old weights."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DriverConfig:
    num_rounds: int
    required_sites: int
    """A training round with fewer valid replies fails the run."""
    seed: int = 0
    timeout_s: float | None = None
    train_config: dict[str, Any] = field(default_factory=dict)
    """Keys every train message carries besides the strategy's: per-round ones only. The run's settings reach
    a site once per run, in its Context (`hydrafl.run_settings`)."""
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
    """Secure aggregation: train rounds learn only the sites' summed update and weight (`hydrafl.server.aggregation.secure_round`)."""
    screening: Screening = field(default_factory=Screening)
    """Reject outlying updates before aggregation (`hydrafl.server.aggregation.screening`); on, it holds each round's replies."""


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
        self.weights_from_deltas = not (
            isinstance(strategy, hooks.ConsumesDeltas) and strategy.consumes_deltas
        )
        self.weighted_by_key: str = (
            strategy.weighted_by_key if isinstance(strategy, FedAvg) else protocol.WEIGHT
        )
        self.privacy = PrivacyLedger.from_run_config(config.run_config, config.secagg)
        self.scheme = Scheme.from_config(config.run_config)
        """How sites compress their updates (`--compress`); replies are decoded as they arrive."""
        self.downloads = DownloadCompression.from_config(config.run_config)
        """What each site holds of the model (`--compress-downloads`): train and evaluate messages carry changes."""

    def run(
        self,
        start: Callable[[], ArrayRecord],
        *,
        resume: bool = False,
        on_round: RoundCallback | None = None,
    ) -> RunResult:
        """`start` gives the initial arrays; it is called only when there is no checkpoint to resume from, so a
        restarted coordinator asks no site for a model (or a curvature probe) it already has."""
        history, first_round = [], 1
        checkpoint = self._load_for_resume() if resume else None
        if checkpoint is not None:
            arrays, history, first_round = (
                checkpoint.arrays,
                checkpoint.history,
                checkpoint.server_round + 1,
            )
            hooks.restore_strategy_state(self.strategy, checkpoint.strategy_state)
            self.privacy.restore(history)
            log.info("resuming after round %d", checkpoint.server_round)
        else:
            arrays = start()
            record = self._evaluate_round(0, arrays)
            history.append(asdict(record))
            self._log_round(record, history, arrays)
            if on_round:
                on_round(record)
        last_end = time.perf_counter()
        for server_round in range(first_round, self.config.num_rounds + 1):
            started = time.perf_counter()
            arrays, record = self._train_round(server_round, arrays)
            evaluation = self._evaluate_round(server_round, arrays)
            record.loss, record.accuracy = evaluation.loss, evaluation.accuracy
            record.bytes_down += evaluation.bytes_down
            record.bytes_up += evaluation.bytes_up
            record.secagg_bytes += evaluation.secagg_bytes
            record.secagg_s += evaluation.secagg_s
            record.gap_s = started - last_end if server_round > first_round else 0.0
            last_end = time.perf_counter()
            record.seconds = last_end - started
            history.append(asdict(record))
            self._log_round(record, history, arrays)
            if on_round:
                on_round(record)
        return RunResult(arrays=arrays, history=history)

    def _train_round(
        self, server_round: int, arrays: ArrayRecord
    ) -> tuple[ArrayRecord, RoundRecord]:
        random.seed(self.config.seed * 100_003 + server_round)  # Flower samples nodes with `random`
        config = ConfigRecord(dict(self.config.train_config))
        record = RoundRecord(round=server_round)
        if isinstance(self.strategy, hooks.QueriesSites):
            self._query_round(server_round, arrays, config, record)
        messages = list(self.strategy.configure_train(server_round, arrays, config, self.grid))
        self.privacy.open_round(messages, len(list(self.grid.get_node_ids())), self.strategy)
        wire = self.downloads.prepare(messages, server_round)
        self._count_down(wire, record)
        if self.config.secagg is None:
            valid: Iterable[Message] = self._valid_replies(
                server_round, self._exchange(wire, server_round), arrays, record
            )
        else:
            secure = SecureRound(
                self._exchange, self.config.secagg, self.weighted_by_key, self.strategy
            )
            try:
                valid = [secure.train(server_round, messages, arrays, record)]
            except SecAggError as error:
                raise RoundFailed(f"round {server_round}: secure aggregation: {error}") from None
        if self.config.screening.enabled:
            valid, rejected = screen_replies(self.config.screening, valid)
            for node, reason in rejected.items():
                self._reject(server_round, node, reason, record)
            record.sites_ok -= len(rejected)
        flower_validates = _flower_validates(self.strategy.aggregate_train)
        if (
            flower_validates or self.config.diagnostics
        ) and self.config.secagg is None:  # secagg: one reply
            valid = self._collect(
                server_round, messages, valid, record, consistent=flower_validates
            )
        received = _as_weights(valid, arrays) if self.weights_from_deltas else valid
        waited = _Waited()
        aggregation_started = time.perf_counter()
        try:
            summed = self.config.secagg is not None and isinstance(
                self.strategy, hooks.TakesSecureSums
            )
            aggregate = self.strategy.aggregate_summed if summed else self.strategy.aggregate_train
            new_arrays, train_metrics = aggregate(server_round, _timed(received, waited))
        except Exception:
            deque(valid, maxlen=0)
            self._require_sites(
                server_round, len(messages), record
            )  # too few sites is the failure to report
            raise
        record.aggregation_s = time.perf_counter() - aggregation_started - waited.seconds
        deque(valid, maxlen=0)  # replies the strategy did not ask for still count
        self._require_sites(server_round, len(messages), record)
        if new_arrays is None:
            raise RoundFailed(
                f"round {server_round}: the strategy produced no model from {record.sites_ok} replies"
            )
        new_arrays = keep_dtypes(new_arrays, arrays)
        self.privacy.close_round(record)
        record.train_loss = _metric(train_metrics, "train_loss")
        return new_arrays, record

    def _query_round(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, record: RoundRecord
    ) -> None:
        """The strategy's questions before training (a planning round), exchanged like the round's own
        messages: same deadline and group id, their bytes counted in the round's."""
        queries = list(self.strategy.configure_query(server_round, arrays, config, self.grid))
        if not queries:
            return
        self._count_down(queries, record)
        replies = sorted(
            self._exchange(queries, server_round), key=lambda reply: reply.metadata.src_node_id
        )
        for reply in replies:
            if not reply.has_error():
                self._count_up(reply, record)
        self.strategy.aggregate_query(server_round, replies)

    def _valid_replies(
        self,
        server_round: int,
        replies: Iterable[Message],
        arrays: ArrayRecord,
        record: RoundRecord,
    ) -> Iterator[Message]:
        """Each reply that passes the checks, as it arrives, with its bytes, data hash and counters recorded: the
        strategy can aggregate it before the next one is produced. A failed site is logged and skipped."""
        for reply in replies:
            if reply.has_error():
                log.warning(
                    "round %d: site %d failed: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    reply.error.reason,
                )
                continue
            sent_bytes = _array_bytes(reply)  # what travelled, before decoding
            try:
                reply = decode_reply(reply, self.scheme)
            except CompressionError as error:
                self._reject(
                    server_round, reply.metadata.src_node_id, f"invalid update: {error}", record
                )
                continue
            if reason := self._invalid_reason(reply, arrays):
                self._reject(server_round, reply.metadata.src_node_id, reason, record)
                continue
            self._count_up(reply, record, sent_bytes)
            node = str(reply.metadata.src_node_id)
            record.data_hash_per_site[node] = _data_hash(reply)
            self.privacy.note_reply(reply, record)
            site_metrics = records(reply.content, MetricRecord)[0]
            for key, per_site in (
                (protocol.TRAINABLE_PARAMS, record.trainable_params_per_site),
                (protocol.PEAK_MEMORY, record.peak_memory_per_site),
            ):
                if key in site_metrics:
                    per_site[node] = int(site_metrics[key])
            record.sites_ok += 1
            yield reply

    def _reject(self, server_round: int, node: int, reason: str, record: RoundRecord) -> None:
        """A reply kept out of aggregation: recorded, logged, and audited where the grid keeps an audit trail."""
        record.rejected_per_site[str(node)] = reason
        log.warning("round %d: site %d rejected: %s", server_round, node, reason)
        if isinstance(self.grid, AuditsRejections):
            self.grid.record_rejection(node, server_round, reason)

    def _collect(
        self,
        server_round: int,
        messages: Sequence[Message],
        valid: Iterable[Message],
        record: RoundRecord,
        *,
        consistent: bool,
    ) -> list[Message]:
        """All valid replies at once, in node order (any grid: the same sums), for what needs every reply
        together: Flower's aggregation (after the consistent-majority filter) and the diagnostics' two passes."""
        replies = sorted(valid, key=lambda reply: reply.metadata.src_node_id)
        if consistent:
            replies = self._consistent(server_round, replies, with_arrays=True)
            record.sites_ok = len(replies)
        self._require_sites(server_round, len(messages), record)
        if self.config.diagnostics:
            self._diagnose(server_round, messages, replies, record)
        return replies

    def _require_sites(self, server_round: int, sent: int, record: RoundRecord) -> None:
        """The minimum-success rule, on the valid replies counted so far; raises RoundFailed when too few."""
        record.sites_failed = sent - record.sites_ok
        if record.sites_ok < self.config.required_sites:
            raise RoundFailed(
                f"round {server_round}: only {record.sites_ok} of {sent} sites replied without error, "
                f"{self.config.required_sites} required (min_sites); the run stops with the round-"
                f"{server_round - 1} model saved"
            )

    def _diagnose(
        self,
        server_round: int,
        messages: Sequence[Message],
        valid: Sequence[Message],
        record: RoundRecord,
    ) -> None:
        """B_pg over the valid deltas, streamed; the cosine to the reference site's delta from the same start."""
        moments = DeltaMoments()
        try:
            for reply in valid:
                weight = float(records(reply.content, MetricRecord)[0][self.weighted_by_key])
                moments.add(
                    {name: array_view(a) for name, a in _delta_record(reply).items()}, weight
                )
            if len(valid) >= 2:
                record.noise_scale = moments.noise_scale()
            if self.config.reference_node is not None:
                reference = Message(
                    messages[0].content,
                    dst_node_id=self.config.reference_node,
                    message_type=messages[0].metadata.message_type,
                )
                [reply] = self._exchange([reference], server_round)
                if reply.has_error():
                    raise RuntimeError(f"the full-data reference site failed: {reply.error.reason}")
                decode_reply(reply, self.scheme)
                pooled = {name: _tensor(array_view(a)) for name, a in _delta_record(reply).items()}
                record.full_data_cosine = cosine_to_reference(moments.mean(), pooled)
        except (
            KeyError,
            ValueError,
            ZeroDeltaError,
        ) as error:  # e.g. Hydra: sites send different tensors
            log.warning("round %d: pseudo-gradient diagnostics undefined: %s", server_round, error)

    def _evaluate_round(self, server_round: int, arrays: ArrayRecord) -> RoundRecord:
        config = ConfigRecord(dict(self.config.evaluate_config))
        messages = list(self.strategy.configure_evaluate(server_round, arrays, config, self.grid))
        messages = self.downloads.prepare(
            messages, server_round, full=server_round == self.config.num_rounds
        )
        record = RoundRecord(round=server_round)
        self._count_down(messages, record)
        if (
            self.config.secagg is not None
        ):  # the sites' metrics and example counts are summed masked, too
            return self._secure_evaluation(server_round, messages, record)
        replies = []
        for reply in sorted(
            self._exchange(messages, server_round), key=lambda reply: reply.metadata.src_node_id
        ):
            reason = reply.error.reason if reply.has_error() else self._invalid_evaluation(reply)
            if reason:
                log.warning(
                    "round %d: site %d failed evaluation: %s",
                    server_round,
                    reply.metadata.src_node_id,
                    reason,
                )
                continue
            replies.append(reply)
        if _flower_validates(self.strategy.aggregate_evaluate):
            replies = self._consistent(server_round, replies, with_arrays=False)
        for reply in replies:
            self._count_up(reply, record)
        record.sites_ok = len(replies)
        metrics = self.strategy.aggregate_evaluate(server_round, replies) if replies else None
        record.loss, record.accuracy = _metric(metrics, "loss"), _metric(metrics, "accuracy")
        return record

    def _secure_evaluation(
        self, server_round: int, messages: Sequence[Message], record: RoundRecord
    ) -> RoundRecord:
        """Evaluation under secure aggregation (`SecureRound.evaluate`); when it cannot complete, the round
        reports no loss or accuracy rather than any site's in the clear."""
        if len(messages) < 2:
            log.warning(
                "round %d: secure evaluation needs at least 2 sites, %d asked; no evaluation",
                server_round,
                len(messages),
            )
            return record
        secure = SecureRound(
            self._exchange, self.config.secagg, self.weighted_by_key, self.strategy
        )
        try:
            reply = secure.evaluate(server_round, messages, record)
        except SecAggError as error:
            log.warning(
                "round %d: secure evaluation failed, no evaluation this round: %s",
                server_round,
                error,
            )
            return record
        metrics = self.strategy.aggregate_evaluate(server_round, [reply])
        record.loss, record.accuracy = _metric(metrics, "loss"), _metric(metrics, "accuracy")
        return record

    def _exchange(self, messages: Sequence[Message], server_round: int) -> Iterator[Message]:
        """The replies as the grid yields them (in the order they arrive), so none need wait for the others."""
        if not messages:
            return iter(())
        for (
            message
        ) in messages:  # Flower's strategies leave group_id empty; runtimes key rounds on it
            message.metadata.group_id = str(server_round)
        return self.downloads.settle(
            messages, self.grid.send_and_receive(messages, timeout=self.config.timeout_s)
        )

    def _invalid_reason(self, reply: Message, arrays: ArrayRecord) -> str:
        # a subnetwork strategy (Hydra and the width baselines) accepts each site's slices, not whole tensors
        checks = isinstance(self.strategy, hooks.ChecksReplyShapes)
        shapes = self.strategy.reply_shapes(reply.metadata.src_node_id, arrays) if checks else None
        try:
            check_train_reply(reply, arrays, self.weighted_by_key, shapes=shapes)
        except InvalidUpdate as error:
            return f"invalid update: {error}"
        return ""

    def _invalid_evaluation(self, reply: Message) -> str:
        try:
            check_evaluate_reply(reply, self.weighted_by_key)
        except InvalidUpdate as error:
            return f"invalid evaluation: {error}"
        return ""

    @staticmethod
    def _consistent(
        server_round: int, replies: list[Message], *, with_arrays: bool
    ) -> list[Message]:
        """The replies whose metric names (and array names) agree with most others: Flower's own aggregation
        refuses a whole round when any reply is laid out differently."""

        def layout(reply: Message) -> tuple:
            return (metric_layout(reply), array_names(reply) if with_arrays else ())

        kept, dropped = consistent_majority(replies, layout)
        for reply in dropped:
            log.warning(
                "round %d: site %d failed: its reply's metric or array names differ from the other sites'",
                server_round,
                reply.metadata.src_node_id,
            )
        return kept

    @staticmethod
    def _count_down(messages: Sequence[Message], record: RoundRecord) -> None:
        for message in messages:
            nbytes = sum(record_nbytes(r) for r in records(message.content, ArrayRecord))
            node = str(message.metadata.dst_node_id)
            record.bytes_down += nbytes
            record.bytes_down_per_site[node] = record.bytes_down_per_site.get(node, 0) + nbytes

    @staticmethod
    def _count_up(reply: Message, record: RoundRecord, nbytes: int | None = None) -> None:
        """Count a reply's array bytes, or `nbytes` (what it carried on the wire, when it was compressed)."""
        nbytes = _array_bytes(reply) if nbytes is None else nbytes
        node = str(reply.metadata.src_node_id)
        record.bytes_up += nbytes
        record.bytes_up_per_site[node] = record.bytes_up_per_site.get(node, 0) + nbytes

    def _load_for_resume(self) -> Checkpoint | None:
        if self.config.run_dir is None:
            raise CheckpointError("resume needs a run directory")
        checkpoint = load_checkpoint(self.config.run_dir)
        if checkpoint is None:
            return None
        saved = {k: v for k, v in checkpoint.run_config.items() if k not in ("rounds", "resume")}
        current = {k: v for k, v in self.config.run_config.items() if k not in ("rounds", "resume")}
        defaults = self.config.run_config_defaults
        added = sorted(
            k for k in current.keys() - saved.keys() if k in defaults and current[k] == defaults[k]
        )
        # a saved key this run does not have (another strategy's knob in an older checkpoint) configures nothing
        changed = sorted(k for k in current if saved.get(k) != current[k] and k not in added)
        if changed:
            raise CheckpointError(
                f"cannot resume {self.config.run_dir}: configuration changed since it was written ({', '.join(changed)})"
            )
        if added:
            log.warning(
                "resuming %s, written before these keys existed; they take their defaults: %s",
                self.config.run_dir,
                ", ".join(f"{k}={defaults[k]!r}" for k in added),
            )
        return checkpoint

    def _log_round(
        self, record: RoundRecord, history: list[dict[str, Any]], arrays: ArrayRecord
    ) -> None:
        log.info(
            "round %d: loss=%s accuracy=%s sites=%d/%d up=%dB down=%dB %.2fs",
            record.round,
            metric(record.loss),
            metric(record.accuracy),
            record.sites_ok,
            record.sites_ok + record.sites_failed,
            record.bytes_up,
            record.bytes_down,
            record.seconds,
        )
        run_dir = self.config.run_dir
        if run_dir is None:
            return
        save_checkpoint(
            run_dir,
            Checkpoint(
                server_round=record.round,
                arrays=arrays,
                strategy_state=hooks.strategy_state(self.strategy),
                history=history,
                run_config=self.config.run_config,
            ),
        )
        rows = [RoundRecord(**entry).tsv_row() for entry in history]
        (run_dir / "rounds.tsv").write_text(
            "\n".join(["\t".join(ROUNDS_TSV_COLUMNS), *rows]) + "\n"
        )
        (run_dir / "history.json").write_text(json.dumps(history, indent=1))


def _data_hash(reply: Message) -> str:
    """The `data-hash` a site's train reply carries in a ConfigRecord ("" from apps that send none)."""
    for record in records(reply.content, ConfigRecord):
        if protocol.DATA_HASH in record:
            return str(record[protocol.DATA_HASH])
    return ""


def _array_bytes(message: Message) -> int:
    return sum(record_nbytes(r) for r in records(message.content, ArrayRecord))


def _delta_record(reply: Message) -> ArrayRecord:
    return records(reply.content, ArrayRecord)[0]


def _as_weights(replies: Iterable[Message], arrays: ArrayRecord) -> Iterator[Message]:
    """Each reply with its delta turned into the site's end weights, for a strategy that averages weights."""
    for reply in replies:
        key = next(key for key, record in reply.content.items() if isinstance(record, ArrayRecord))
        reply.content[key] = weights_from_delta(arrays, reply.content[key])
        yield reply


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


def _tensor(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(
        np.array(array, dtype=np.float64)
    )  # a writable float64 copy of a wire view


def _flower_validates(method: Callable) -> bool:
    """Flower's built-in aggregation (FedAvg and its family) raises on replies of differing layouts."""
    return getattr(method, "__func__", method).__module__.startswith("flwr.")


def _metric(metrics: MetricRecord | None, key: str) -> float | None:
    if metrics is None or key not in metrics:
        return None
    return float(metrics[key])
