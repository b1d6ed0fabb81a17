"""Federated evaluation of a round's model: the strategy's evaluate messages out, each site's loss and accuracy
back, checked, and averaged by the strategy. Under secure aggregation the sites' metrics and example counts
are summed masked too (`SecureRound.evaluate`), so no site's evaluation is seen in the clear; when that cannot
complete, the round reports no loss or accuracy rather than any site's."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from hydrafl.rounds import RoundRecord
from hydrafl.secagg import SecAggError, SecAggParams
from hydrafl.server.aggregation.exchange import Exchange
from hydrafl.server.aggregation.flower_adapter import FlowerAdapter
from hydrafl.server.aggregation.reply_check import ReplyCheck
from hydrafl.server.aggregation.secure_round import SecureRound
from hydrafl.server.aggregation.traffic import count_up

log = logging.getLogger(__name__)


class Evaluation:
    """Evaluates models through `adapter`'s strategy over `exchange`; the model of `final_round` goes whole."""

    def __init__(
        self,
        adapter: FlowerAdapter,
        exchange: Exchange,
        check: ReplyCheck,
        *,
        evaluate_config: Mapping[str, Any],
        final_round: int,
        secagg: SecAggParams | None,
    ) -> None:
        self.adapter = adapter
        self.exchange = exchange
        self.check = check
        self.evaluate_config = evaluate_config
        self.final_round = final_round
        self.secagg = secagg

    def run(self, server_round: int, arrays: ArrayRecord) -> RoundRecord:
        """A record of `server_round` with the evaluation's loss, accuracy, sites and bytes."""
        config = ConfigRecord(dict(self.evaluate_config))
        strategy = self.adapter.strategy
        messages = list(
            strategy.configure_evaluate(server_round, arrays, config, self.exchange.grid)
        )
        record = RoundRecord(round=server_round)
        full = server_round == self.final_round
        messages = self.exchange.outgoing(messages, server_round, record, full=full)
        if self.secagg is not None:
            return self._secure(server_round, messages, record, self.secagg)
        replies = []
        for reply in sorted(
            self.exchange(messages, server_round), key=lambda reply: reply.metadata.src_node_id
        ):
            reason = reply.error.reason if reply.has_error() else self.check.evaluate(reply)
            if reason:
                node = reply.metadata.src_node_id
                log.warning("round %d: site %d failed evaluation: %s", server_round, node, reason)
                continue
            replies.append(reply)
        replies = self.adapter.matching(server_round, replies, train=False)
        for reply in replies:
            count_up(reply, record)
        record.sites_ok = len(replies)
        metrics = self.adapter.aggregate_evaluate(server_round, replies) if replies else None
        record.loss, record.accuracy = (
            metric_value(metrics, "loss"),
            metric_value(metrics, "accuracy"),
        )
        return record

    def _secure(
        self,
        server_round: int,
        messages: Sequence[Message],
        record: RoundRecord,
        secagg: SecAggParams,
    ) -> RoundRecord:
        if len(messages) < 2:
            log.warning(
                "round %d: secure evaluation needs at least 2 sites, %d asked; no evaluation",
                server_round,
                len(messages),
            )
            return record
        secure = SecureRound(
            self.exchange, secagg, self.adapter.weighted_by_key, self.adapter.strategy
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
        metrics = self.adapter.aggregate_evaluate(server_round, [reply])
        record.loss, record.accuracy = (
            metric_value(metrics, "loss"),
            metric_value(metrics, "accuracy"),
        )
        return record


def metric_value(metrics: MetricRecord | None, key: str) -> float | None:
    """`key` of an aggregated MetricRecord, None when the strategy returned none or left it out."""
    if metrics is None or key not in metrics:
        return None
    return float(metrics[key])
