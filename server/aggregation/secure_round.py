"""The coordinator's side of secure aggregation over the Message API: one training round's protocol stages
around the strategy's own train messages, ending in one synthetic reply that holds the survivors' weighted
mean update, their total weight and the weighted mean of their train loss, all decoded from one masked sum
(what a weighted-mean strategy computes from all replies: the same result). Evaluation runs the same protocol
on the evaluate messages (purpose "evaluate"): the sites' loss and accuracy, weighted by their test examples,
are summed masked too, so under --secagg no per-site metric or example count travels in the clear.

With distributed DP (`secagg.noise`) every site weighs 1 and adds its noise share before masking: the reply
holds the survivors' noised mean, which the strategy steps on as it is (no coordinator noise on top).

A subnetwork strategy's sites train slices: each expands its slices to full shapes with a 0/1 weight per
coordinate, and the one reply holds the per-coordinate sums instead (`hooks.TakesSecureSums`). With distributed
DP every site weighs 1 there too, and its noise share covers every coordinate, so the strategy's masked mean
(sum / n_l over the n_l survivors that trained a coordinate) carries central DP's z C / n_l.

With the model kept on disk (`files`), the masked sum lives in a file and the reply's mean update in another,
both a window at a time (`secure_on_disk`): the same bits as in memory.

Stages: a keys query, a shares query, the train messages carrying each site's routed shares (the replies are
masked vectors, summed as they arrive), a check query (survivors sign the survivor set), an unmask query. Every
site message is checked before it reaches the `ServerSession`; a bad one fails that site only. Fewer survivors
than the threshold, or a secret that no threshold of shares rebuilds as its owner committed, halt the round
(SecAggError): nothing is applied.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import config_record_to_proto

from hydrafl import protocol
from hydrafl.arrays import record_nbytes
from hydrafl.secagg import (
    SecAggError,
    SecAggParams,
    ServerSession,
    decode_metrics,
    decode_sum,
    wire,
)
from hydrafl.secagg.field_sum import FieldSum
from hydrafl.secagg.noise import DistributedNoise
from hydrafl.secagg.quantize import METRIC_SLOTS
from hydrafl.secagg.server import Unmasked
from hydrafl.server.aggregation.secure_on_disk import decode_mean, decode_sums, sum_file, words_of
from hydrafl.strategies.by_tensor import RoundFiles
from hydrafl.strategies.hooks import TakesSecureSums
from hydrafl.updates import InvalidUpdate, records

log = logging.getLogger(__name__)

Exchange = Callable[[Sequence[Message], int], Iterator[Message]]

METRIC_RANGE = 64.0
"""Loss-like metrics are summed clipped to [0, 64): a site's loss above 64 counts as 64 (a cross-entropy that
high is a diverged site; a class-balanced guess over 1000 classes is 6.9). With Q = 2^22 levels, each site's
rounding moves the decoded mean by under max_weight x 64 / 2^22 / total weight (`quantize.metric_bound`)."""
TRAIN_METRICS = (("train_loss", METRIC_RANGE),)
"""What a secure train round sums of each site's train metrics, and their ranges; the site's other train
metrics (throughput, memory, MFU, restarts, data hash, local epsilon) never leave it under --secagg."""
EVALUATE_METRICS = (("loss", METRIC_RANGE), ("accuracy", 1.0))
"""What a secure evaluation sums of each site's evaluate reply (accuracy lies in [0, 1])."""


class RoundCounters(Protocol):
    """The round driver's record of a round, which this fills in (`driver.RoundRecord`)."""

    sites_ok: int
    bytes_up: int
    bytes_up_per_site: dict[str, int]
    secagg_bytes: int
    secagg_s: float


class SecureRound:
    """Runs one round's secure aggregation; `bytes` and `seconds` are the protocol's own cost afterwards."""

    def __init__(
        self,
        exchange: Exchange,
        params: SecAggParams,
        weighted_by_key: str,
        strategy: object = None,
        files: RoundFiles | None = None,
    ) -> None:
        """`files`: the round's folder, for a model kept on disk: the train round's sums go to files there."""
        self.exchange = exchange
        self.files = files
        self.params = params
        self.weighted_by_key = weighted_by_key
        self.subnets = strategy if isinstance(strategy, TakesSecureSums) else None
        self.bytes = 0
        self.seconds = 0.0
        self.survivors: list[int] = []
        self.bytes_up_per_site: dict[str, int] = {}

    def train(
        self,
        server_round: int,
        messages: Sequence[Message],
        arrays: ArrayRecord,
        record: RoundCounters,
    ) -> Message:
        """The synthetic reply of the round's `messages` (train messages, one per site) from `arrays`; the
        protocol's bytes and seconds, the survivors and their uploads go into `record` (also when it halts)."""
        try:
            reply = self._train(server_round, messages, arrays)
        finally:
            record.secagg_bytes, record.secagg_s = self.bytes, self.seconds
        record.sites_ok = len(self.survivors)
        record.bytes_up_per_site.update(self.bytes_up_per_site)
        record.bytes_up += sum(self.bytes_up_per_site.values())
        return reply

    def evaluate(
        self, server_round: int, messages: Sequence[Message], record: RoundCounters
    ) -> Message:
        """The synthetic evaluate reply of the round's evaluate `messages`: the survivors' weighted mean of each
        of EVALUATE_METRICS and their total weight, summed by the same protocol (a round of its own, purpose
        "evaluate"), so no site's loss, accuracy or example count reaches the coordinator."""
        layout = wire.Layout(self.weighted_by_key, [], metrics=list(EVALUATE_METRICS))
        try:
            unmasked, _, means = self._protocol(server_round, messages, layout, 1, "evaluate")
            weights = self._weights(server_round, unmasked.read(0, 1))
        finally:
            record.secagg_bytes, record.secagg_s = self.bytes, self.seconds
        record.sites_ok = len(self.survivors)
        record.bytes_up_per_site.update(self.bytes_up_per_site)
        record.bytes_up += sum(self.bytes_up_per_site.values())
        content = RecordDict(
            {"metrics": MetricRecord({**means, self.weighted_by_key: int(weights[0])})}
        )
        return Message(content, reply_to=messages[0])

    def _train(
        self, server_round: int, messages: Sequence[Message], arrays: ArrayRecord
    ) -> Message:
        layout = self._layout(messages, arrays)
        size = sum(math.prod(arrays[name].shape) for name in layout.names)
        length = 2 * size if layout.per_coordinate else 1 + size
        if (
            self.params.dp_clip
        ):  # before any site is asked: a sum that could wrap is refused, not decoded
            DistributedNoise.of(layout.scaled(self.params), size, len(messages)).check_range()
        if self.files is not None:
            return self._train_on_disk(server_round, messages, arrays, layout, length, self.files)
        unmasked, count, means = self._protocol(
            server_round, messages, layout, length, "train", arrays
        )
        started = time.perf_counter()
        weights, weighted = decode_sum(
            unmasked.read(0, length),
            count,
            layout.scaled(self.params),
            per_coordinate=layout.per_coordinate,
        )
        self.seconds += time.perf_counter() - started
        self._weights(server_round, weights)
        if layout.per_coordinate:
            content = {
                "sums": _unflatten(weighted, arrays, layout.names, "float32"),
                "weights": _unflatten(weights.astype(np.float64), arrays, layout.names, "float32"),
            }
        else:
            content = {"arrays": _unflatten(weighted / weights[0], arrays, layout.names)}
        return _summed_reply(messages[0], content, int(weights.max()), self.weighted_by_key, means)

    def _train_on_disk(
        self,
        server_round: int,
        messages: Sequence[Message],
        arrays: ArrayRecord,
        layout: wire.Layout,
        length: int,
        files: RoundFiles,
    ) -> Message:
        """`_train` with the masked sum in a file and the mean update (a subnetwork's per-coordinate sums)
        decoded into files, a window at a time (`secure_on_disk`)."""
        with sum_file(files, length + METRIC_SLOTS * len(layout.metrics)) as total:
            unmasked, count, means = self._protocol(
                server_round, messages, layout, length, "train", arrays, total
            )
            started = time.perf_counter()
            decode = decode_sums if layout.per_coordinate else decode_mean
            content, weight = decode(
                unmasked, count, layout.scaled(self.params), arrays, layout.names, files
            )
            self.seconds += time.perf_counter() - started
        return _summed_reply(messages[0], content, weight, self.weighted_by_key, means)

    def _protocol(
        self,
        server_round: int,
        messages: Sequence[Message],
        layout: wire.Layout,
        length: int,
        purpose: str,
        arrays: ArrayRecord | None = None,
        total: FieldSum | None = None,
    ) -> tuple[Unmasked, int, dict[str, float]]:
        """One secure round over `messages` (vectors of `length` elements, then the layout's metric slots),
        summed into `total` (by default in memory): the unmasked sum, how many sites it sums and the metric
        means."""
        params = replace(self.params, purpose=purpose)
        cut = length
        length += METRIC_SLOTS * len(layout.metrics)
        participants = [m.metadata.dst_node_id for m in messages]
        started = time.perf_counter()
        session = ServerSession.start(server_round, participants, params, length, total)
        setup = wire.keys_request(server_round, participants, params, layout)
        self._ask(
            server_round,
            protocol.QUERY_SECAGG_KEYS,
            dict.fromkeys(participants, setup),
            lambda node, record: session.receive_keys(node, wire.parse_keys_reply(record)),
        )
        requests = {
            node: wire.shares_request(node, session.keys_for(node)) for node in session.keys
        }
        self._ask(
            server_round,
            protocol.QUERY_SECAGG_SHARES,
            requests,
            lambda node, record: session.receive_shares(node, wire.parse_sealed(record)),
        )
        self.seconds += time.perf_counter() - started
        routed = [
            _with_record(m, self._routed(session, m.metadata.dst_node_id, arrays is not None))
            for m in messages
            if m.metadata.dst_node_id in session.sealed
        ]
        self.bytes += sum(_config_bytes(m.content[protocol.SECAGG_RECORD]) for m in routed)
        for reply in self.exchange(routed, server_round):
            self._receive_masked(session, reply)
        started = time.perf_counter()
        check = wire.check_request(session.check_request())
        self._ask(
            server_round,
            protocol.QUERY_SECAGG_CHECK,
            dict.fromkeys(session.survivors, check),
            lambda node, record: session.receive_signature(node, wire.parse_check_reply(record)),
        )
        request = wire.unmask_request(*session.unmask_request())
        self._ask(
            server_round,
            protocol.QUERY_SECAGG_UNMASK,
            dict.fromkeys(session.signatures, request),
            lambda node, record: session.receive_unmask(node, wire.parse_unmask_reply(record)),
        )
        unmasked, count = session.unmasked()
        decoded = decode_metrics(
            unmasked.read(cut, length - cut),
            [r for _, r in layout.metrics],
            layout.scaled(params),
        )
        self.seconds += time.perf_counter() - started
        self.survivors = list(session.survivors)
        means = {
            name: mean
            for (name, _), (mean, _) in zip(layout.metrics, decoded, strict=True)
            if mean is not None
        }
        return unmasked, count, means

    @staticmethod
    def _weights(server_round: int, weights: np.ndarray) -> np.ndarray:
        """The decoded weights, or SecAggError when they sum to 0 (nothing to divide by)."""
        if not weights.any():
            raise SecAggError(
                f"round {server_round}: the survivors' weights sum to 0; the round halts"
            )
        return weights

    def _layout(self, messages: Sequence[Message], arrays: ArrayRecord) -> wire.Layout:
        if self.subnets is not None:
            names = list(arrays)
            return wire.Layout(
                self.weighted_by_key,
                names,
                True,
                self.subnets.count_once or bool(self.params.dp_clip),
                [tuple(arrays[name].shape) for name in names],
                list(TRAIN_METRICS),
            )
        names = list(records(messages[0].content, ArrayRecord)[0])
        if any(list(records(m.content, ArrayRecord)[0]) != names for m in messages):
            raise SecAggError(
                "the strategy sent sites different arrays: their updates cannot be summed"
            )
        return wire.Layout(
            self.weighted_by_key,
            names,
            count_once=bool(self.params.dp_clip),
            metrics=list(TRAIN_METRICS),
        )

    def _routed(self, session: ServerSession, node: int, train: bool) -> dict:
        """What a site's train message carries for the protocol: its shares, and a subnetwork's slices."""
        routed = {**wire.sealed_record(session.shares_for(node)), "length": session.length}
        if self.subnets is not None and train:
            routed.update(
                wire.slices_record(
                    {n: (sl.dim, sl.index) for n, sl in self.subnets.site_slices(node).items()}
                )
            )
        return routed

    def _ask(
        self,
        server_round: int,
        kind: str,
        requests: dict[int, dict],
        accept: Callable[[int, ConfigRecord], None],
    ) -> None:
        """Asks `kind` of each site and hands each answer to `accept`; a site whose answer is an error or
        malformed (`accept` raised SecAggError, changing nothing) is left out of the rest of the round."""
        queries = [
            Message(
                RecordDict({protocol.SECAGG_RECORD: ConfigRecord(request)}),
                dst_node_id=node,
                message_type=kind,
            )
            for node, request in requests.items()
        ]
        log.info(
            "round %d: secure aggregation waits for %d sites to answer %s (a site that does not answer "
            "drops out at the round's deadline)",
            server_round,
            len(queries),
            kind,
        )
        self.bytes += sum(_config_bytes(q.content[protocol.SECAGG_RECORD]) for q in queries)
        for reply in sorted(
            self.exchange(queries, server_round), key=lambda r: r.metadata.src_node_id
        ):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning(
                    "round %d: site %d failed %s: %s", server_round, node, kind, reply.error.reason
                )
                continue
            record = (
                reply.content.get(protocol.SECAGG_RECORD)
                if protocol.SECAGG_RECORD in reply.content
                else None
            )
            if not isinstance(record, ConfigRecord) or len(reply.content) != 1:
                log.warning(
                    "round %d: site %d answered %s without its one secure-aggregation record",
                    server_round,
                    node,
                    kind,
                )
                continue
            self.bytes += _config_bytes(record)
            try:
                accept(node, record)
            except SecAggError as error:
                log.warning("round %d: site %d failed %s: %s", server_round, node, kind, error)

    def _receive_masked(self, session: ServerSession, reply: Message) -> None:
        """Adds a site's masked vector to the session's sum: the reply must hold that one array and nothing
        else (no metric, count or hash travels in the clear)."""
        node = reply.metadata.src_node_id
        try:
            if reply.has_error():
                raise SecAggError(reply.error.reason)
            arrays = records(reply.content, ArrayRecord)
            if (
                len(arrays) != 1
                or list(arrays[0]) != [protocol.SECAGG_MASKED]
                or len(reply.content) != 1
            ):
                raise SecAggError(
                    f"expected one ArrayRecord holding {protocol.SECAGG_MASKED!r} and nothing else"
                )
            array = arrays[0][protocol.SECAGG_MASKED]
            if array.dtype != "uint32" or tuple(array.shape) != (session.length,):
                raise SecAggError(f"the masked vector must be uint32 of shape ({session.length},)")
            session.receive_masked(node, words_of(array))
        except (SecAggError, InvalidUpdate, ValueError, KeyError, OSError) as error:
            if session.total.lost:  # not this site's fault: nothing can be summed any more
                raise SecAggError(f"the masked sum is lost: {session.total.lost}") from error
            log.warning("site %d failed: secure aggregation: %s", node, error)
            return
        self.bytes_up_per_site[str(node)] = record_nbytes(arrays[0])


def _with_record(message: Message, routed: dict) -> Message:
    """A copy of a train message that also carries what is routed to its site (strategies share one
    RecordDict among all their messages, so it is never edited in place)."""
    content = RecordDict(
        {**dict(message.content.items()), protocol.SECAGG_RECORD: ConfigRecord(routed)}
    )
    return Message(
        content,
        dst_node_id=message.metadata.dst_node_id,
        message_type=message.metadata.message_type,
    )


def _unflatten(
    flat: np.ndarray, arrays: ArrayRecord, names: list[str], dtype: str | None = None
) -> ArrayRecord:
    """`flat` cut into `names`' shapes (in `arrays`' dtypes unless `dtype`)."""
    out, offset = {}, 0
    for name in names:
        shape = tuple(arrays[name].shape)
        size = math.prod(shape)
        out[name] = Array(
            flat[offset : offset + size].reshape(shape).astype(dtype or arrays[name].dtype)
        )
        offset += size
    return ArrayRecord(out)


def _summed_reply(
    template: Message,
    arrays: dict[str, ArrayRecord],
    total_weight: int,
    weighted_by_key: str,
    means: dict[str, float],
) -> Message:
    """One reply standing for all survivors: their weighted mean delta (or per-coordinate sums), their total
    weight, and the weighted mean of each metric decoded from the masked sum (`TRAIN_METRICS`)."""
    content = RecordDict(
        {**arrays, "metrics": MetricRecord({**means, weighted_by_key: total_weight})}
    )
    return Message(content, reply_to=template)


def _config_bytes(record: ConfigRecord) -> int:
    return config_record_to_proto(record).ByteSize()
