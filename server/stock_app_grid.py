"""The grid a stock Flower ServerApp runs on, recording the rounds the app itself never reports.

Each broadcast of train messages is one round (one per round of Flower's `Strategy.start`); the round's train
and evaluate replies give its record as Flower's FedAvg aggregates them by default (`aggregate_metricrecords`,
weighted by `num-examples`): the sites that answered or failed, train loss, evaluation loss and accuracy. The
records go to the run's history, which `run status`, the dashboard and `/metrics` show as for any run; a run in
which no site answered any message successfully is told apart from one that finished (`no_successful_reply`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from flwr.app import Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords

from hydrafl import protocol
from hydrafl.bounded import bounded
from hydrafl.rounds import RoundRecord
from hydrafl.server.lease_keeper import LeasedGrid, RunStopped
from hydrafl.server.transport.replies import message_kind
from hydrafl.updates import records

LOSS_KEYS = ("loss", "train_loss", "train-loss", "eval_loss")
"""Where a ClientApp puts its loss (Flower's templates: `train_loss`, `eval_loss`); the first present is the
round's."""


class StockAppGrid(LeasedGrid):
    """A LeasedGrid that counts a stock app's rounds and records each one from the replies it pulls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.train_rounds = 0
        self.history: list[dict[str, Any]] = []
        self.sent = 0
        self.succeeded = 0
        self.failures: list[str] = []
        """`round R, node N: reason` of each error reply, in the order they came."""
        self._metrics: dict[str, list[MetricRecord]] = {}
        """This round's train and evaluate MetricRecords, by message kind."""

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        messages = list(messages)
        if any(
            message_kind(message.metadata.message_type) == MessageType.TRAIN for message in messages
        ):
            if self.train_rounds:
                self.store.set_run_status(
                    self.run.run_id, "running", rounds_done=self.train_rounds, history=self.history
                )
                if self.store.stop_requested(self.run.run_id):
                    raise RunStopped(f"stopped by an administrator after round {self.train_rounds}")
            self.train_rounds += 1
            self.history.append(dataclasses.asdict(RoundRecord(round=self.train_rounds)))
            self._metrics = {}
        self.sent += len(messages)
        return super().push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        for reply in super().pull_messages(message_ids):
            self._record(reply)
            yield reply

    @property
    def no_successful_reply(self) -> str:
        """Why the run cannot count as finished when it sent messages and no site answered one; "" otherwise."""
        if not self.sent or self.succeeded:
            return ""
        reasons = "; ".join(self.failures[:3]) or "no site replied"
        return bounded(
            f"no site answered any of the run's {self.sent} messages successfully: {reasons}"
        )

    def _record(self, reply: Message) -> None:
        round_ = self.train_rounds
        if reply.has_error():
            node = reply.metadata.src_node_id
            self.failures.append(f"round {round_}, node {node}: {reply.error.reason}")
            if self.history:
                self.history[-1]["sites_failed"] += 1
            return
        self.succeeded += 1
        if not self.history:
            return
        entry, kind = self.history[-1], message_kind(reply.metadata.message_type)
        if kind not in (MessageType.TRAIN, MessageType.EVALUATE):
            return
        folded = self._fold(kind, records(reply.content, MetricRecord))
        if kind == MessageType.TRAIN:
            entry["sites_ok"] += 1
            entry["train_loss"] = _first(folded, LOSS_KEYS)
        else:
            entry["loss"] = _first(folded, LOSS_KEYS)
            entry["accuracy"] = _first(folded, ("accuracy", "acc", "eval_acc"))

    def _fold(self, kind: str, metrics: list[MetricRecord]) -> MetricRecord:
        """The round's `kind` metrics so far, aggregated as Flower's FedAvg does by default."""
        kept = self._metrics.setdefault(kind, [])
        kept.extend(record for record in metrics if protocol.WEIGHT in record)
        if not kept:
            return MetricRecord()
        return aggregate_metricrecords(
            [RecordDict({"metrics": record}) for record in kept], protocol.WEIGHT
        )


def _first(values: MetricRecord, keys: tuple[str, ...]) -> float | None:
    for key in keys:
        if isinstance(values.get(key), (int, float)):
            return float(values[key])
    return None
