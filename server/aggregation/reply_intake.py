"""Decode and check, as each train reply arrives: a compressed reply is decoded in the run's scheme (never the
reply's), then checked (`reply_check`); a valid one has its bytes (as they travelled), data hash, per-site
counters and privacy spending recorded before the next reply is asked for, so a strategy that aggregates a
stream holds one reply at a time. A failed site is logged and skipped; an invalid reply is rejected."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from hydrafl import protocol
from hydrafl.compression.layout import CompressionError, Scheme
from hydrafl.compression.receive import decode_reply
from hydrafl.privacy.ledger import PrivacyLedger
from hydrafl.rounds import RoundRecord
from hydrafl.server.aggregation.rejections import Rejections
from hydrafl.server.aggregation.reply_check import ReplyCheck
from hydrafl.server.aggregation.traffic import array_bytes, count_up
from hydrafl.updates import records

log = logging.getLogger(__name__)


class ReplyIntake:
    """The valid train replies of a round, decoded in `scheme` and checked by `check`, as they arrive."""

    def __init__(
        self, scheme: Scheme, check: ReplyCheck, rejections: Rejections, privacy: PrivacyLedger
    ) -> None:
        self.scheme = scheme
        self.check = check
        self.rejections = rejections
        self.privacy = privacy

    def valid(
        self,
        server_round: int,
        replies: Iterable[Message],
        arrays: ArrayRecord,
        record: RoundRecord,
    ) -> Iterator[Message]:
        """Each reply of `replies` that decodes and passes the checks against `arrays`, recorded in `record`."""
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("round %d: site %d failed: %s", server_round, node, reply.error.reason)
                continue
            sent_bytes = array_bytes(reply)  # what travelled, before decoding
            try:
                reply = decode_reply(reply, self.scheme)
            except CompressionError as error:
                self.rejections.reject(server_round, node, f"invalid update: {error}", record)
                continue
            if reason := self.check.train(reply, arrays):
                self.rejections.reject(server_round, node, reason, record)
                continue
            count_up(reply, record, sent_bytes)
            record.data_hash_per_site[str(node)] = _data_hash(reply)
            self.privacy.note_reply(reply, record)
            _count_site(reply, record)
            record.sites_ok += 1
            yield reply


def _data_hash(reply: Message) -> str:
    """The `data-hash` a site's train reply carries in a ConfigRecord ("" from apps that send none)."""
    for config in records(reply.content, ConfigRecord):
        if protocol.DATA_HASH in config:
            return str(config[protocol.DATA_HASH])
    return ""


def _count_site(reply: Message, record: RoundRecord) -> None:
    """The trained coordinates and peak memory the site's train metrics report, when they do."""
    site_metrics = records(reply.content, MetricRecord)[0]
    node = str(reply.metadata.src_node_id)
    for key, per_site in (
        (protocol.TRAINABLE_PARAMS, record.trainable_params_per_site),
        (protocol.PEAK_MEMORY, record.peak_memory_per_site),
    ):
        if key in site_metrics:
            per_site[node] = int(site_metrics[key])
