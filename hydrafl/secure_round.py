"""The coordinator's side of secure aggregation over the Message API: one training round's protocol stages
around the strategy's own train messages, ending in one synthetic reply that holds the survivors' weighted
mean update and their total weight (what a weighted-mean strategy computes from all replies: the same result).

With distributed DP (`secagg.noise`) every site weighs 1 and adds its noise share before masking: the reply
holds the survivors' noised mean, which the strategy steps on as it is (no coordinator noise on top).

A subnetwork strategy's sites train slices: each expands its slices to full shapes with a 0/1 weight per
coordinate, and the one reply holds the per-coordinate sums instead (`hooks.TakesSecureSums`).

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
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import config_record_to_proto

from hydrafl import protocol
from hydrafl.arrays import record_nbytes
from hydrafl.secagg import SecAggError, SecAggParams, ServerSession, decode_sum, wire
from hydrafl.secagg.noise import DistributedNoise
from hydrafl.strategies.hooks import TakesSecureSums
from hydrafl.updates import InvalidUpdate, check_metrics, records

log = logging.getLogger(__name__)

Exchange = Callable[[Sequence[Message], int], Iterator[Message]]


class RoundCounters(Protocol):
    """The round driver's record of a round, which this fills in (`driver.RoundRecord`)."""

    sites_ok: int
    bytes_up: int
    bytes_up_per_site: dict[str, int]
    secagg_bytes: int
    secagg_s: float


class SecureRound:
    """Runs one round's secure aggregation; `bytes` and `seconds` are the protocol's own cost afterwards."""

    def __init__(self, exchange: Exchange, params: SecAggParams, weighted_by_key: str, strategy: object = None) -> None:
        self.exchange = exchange
        self.params = params
        self.weighted_by_key = weighted_by_key
        self.subnets = strategy if isinstance(strategy, TakesSecureSums) else None
        self.bytes = 0
        self.seconds = 0.0
        self.survivors: list[int] = []
        self.bytes_up_per_site: dict[str, int] = {}

    def train(self, server_round: int, messages: Sequence[Message], arrays: ArrayRecord, record: RoundCounters) -> Message:
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

    def _train(self, server_round: int, messages: Sequence[Message], arrays: ArrayRecord) -> Message:
        layout = self._layout(messages, arrays)
        size = sum(math.prod(arrays[name].shape) for name in layout.names)
        length = 2 * size if layout.per_coordinate else 1 + size
        participants = [m.metadata.dst_node_id for m in messages]
        if self.params.dp_clip:  # before any site is asked: a sum that could wrap is refused, not decoded
            DistributedNoise.of(layout.scaled(self.params), size, len(participants)).check_range()
        started = time.perf_counter()
        session = ServerSession.start(server_round, participants, self.params, length)
        setup = wire.keys_request(server_round, participants, self.params, layout)
        self._ask(server_round, protocol.QUERY_SECAGG_KEYS, {n: setup for n in participants},
                  lambda node, record: session.receive_keys(node, wire.parse_keys_reply(record)))
        requests = {node: wire.shares_request(node, session.keys_for(node)) for node in session.keys}
        self._ask(server_round, protocol.QUERY_SECAGG_SHARES, requests,
                  lambda node, record: session.receive_shares(node, wire.parse_sealed(record)))
        self.seconds += time.perf_counter() - started
        routed = [_with_record(m, self._routed(session, m.metadata.dst_node_id)) for m in messages
                  if m.metadata.dst_node_id in session.sealed]
        self.bytes += sum(_config_bytes(m.content[protocol.SECAGG_RECORD]) for m in routed)
        metrics = [self._receive_masked(session, reply) for reply in self.exchange(routed, server_round)]
        started = time.perf_counter()
        check = wire.check_request(session.check_request())
        self._ask(server_round, protocol.QUERY_SECAGG_CHECK, {n: check for n in session.survivors},
                  lambda node, record: session.receive_signature(node, wire.parse_check_reply(record)))
        request = wire.unmask_request(*session.unmask_request())
        self._ask(server_round, protocol.QUERY_SECAGG_UNMASK, {n: request for n in session.signatures},
                  lambda node, record: session.receive_unmask(node, wire.parse_unmask_reply(record)))
        total, count = session.result()
        survivors = list(session.survivors)
        weights, weighted = decode_sum(total, count, layout.scaled(self.params), per_coordinate=layout.per_coordinate)
        self.seconds += time.perf_counter() - started
        self.survivors = survivors
        if not weights.any():
            raise SecAggError(f"round {server_round}: the survivors' weights sum to 0; the round halts")
        kept = [m for m in metrics if m is not None]
        if layout.per_coordinate:
            content = {"sums": _unflatten(weighted, arrays, layout.names, "float32"),
                       "weights": _unflatten(weights.astype(np.float64), arrays, layout.names, "float32")}
        else:
            content = {"arrays": _unflatten(weighted / weights[0], arrays, layout.names)}
        return _summed_reply(messages[0], content, int(weights.max()), self.weighted_by_key, kept)

    def _layout(self, messages: Sequence[Message], arrays: ArrayRecord) -> wire.Layout:
        if self.subnets is not None:
            names = list(arrays)
            return wire.Layout(self.weighted_by_key, names, True, self.subnets.count_once,
                               [tuple(arrays[name].shape) for name in names])
        names = list(records(messages[0].content, ArrayRecord)[0])
        if any(list(records(m.content, ArrayRecord)[0]) != names for m in messages):
            raise SecAggError("the strategy sent sites different arrays: their updates cannot be summed")
        return wire.Layout(self.weighted_by_key, names, count_once=bool(self.params.dp_clip))

    def _routed(self, session: ServerSession, node: int) -> dict:
        """What a site's train message carries for the protocol: its shares, and a subnetwork's slices."""
        routed = {**wire.sealed_record(session.shares_for(node)), "length": session.length}
        if self.subnets is not None:
            routed.update(wire.slices_record({n: (sl.dim, sl.index) for n, sl in self.subnets.site_slices(node).items()}))
        return routed

    def _ask(self, server_round: int, kind: str, requests: dict[int, dict], accept: Callable[[int, ConfigRecord], None]) -> None:
        """Asks `kind` of each site and hands each answer to `accept`; a site whose answer is an error or
        malformed (`accept` raised SecAggError, changing nothing) is left out of the rest of the round."""
        queries = [Message(RecordDict({protocol.SECAGG_RECORD: ConfigRecord(request)}), dst_node_id=node,
                           message_type=kind) for node, request in requests.items()]
        log.info("round %d: secure aggregation waits for %d sites to answer %s (a site that does not answer "
                 "drops out at the round's deadline)", server_round, len(queries), kind)
        self.bytes += sum(_config_bytes(q.content[protocol.SECAGG_RECORD]) for q in queries)
        for reply in sorted(self.exchange(queries, server_round), key=lambda r: r.metadata.src_node_id):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("round %d: site %d failed %s: %s", server_round, node, kind, reply.error.reason)
                continue
            record = reply.content.get(protocol.SECAGG_RECORD) if protocol.SECAGG_RECORD in reply.content else None
            if not isinstance(record, ConfigRecord) or len(reply.content) != 1:
                log.warning("round %d: site %d answered %s without its one secure-aggregation record", server_round, node, kind)
                continue
            self.bytes += _config_bytes(record)
            try:
                accept(node, record)
            except SecAggError as error:
                log.warning("round %d: site %d failed %s: %s", server_round, node, kind, error)

    def _receive_masked(self, session: ServerSession, reply: Message) -> MetricRecord | None:
        """Adds a site's masked vector to the session's sum; its metrics (weight excluded) when accepted."""
        node = reply.metadata.src_node_id
        try:
            if reply.has_error():
                raise SecAggError(reply.error.reason)
            arrays, metrics = records(reply.content, ArrayRecord), records(reply.content, MetricRecord)
            if len(arrays) != 1 or list(arrays[0]) != [protocol.SECAGG_MASKED] or len(metrics) != 1:
                raise SecAggError(f"expected one ArrayRecord holding {protocol.SECAGG_MASKED!r} and one MetricRecord")
            check_metrics(metrics[0], None)
            array = arrays[0][protocol.SECAGG_MASKED]
            if array.dtype != "uint32" or tuple(array.shape) != (session.length,):
                raise SecAggError(f"the masked vector must be uint32 of shape ({session.length},)")
            session.receive_masked(node, array.numpy())
        except (SecAggError, InvalidUpdate, ValueError) as error:
            log.warning("site %d failed: secure aggregation: %s", node, error)
            return None
        self.bytes_up_per_site[str(node)] = record_nbytes(arrays[0])
        return metrics[0]


def _with_record(message: Message, routed: dict) -> Message:
    """A copy of a train message that also carries what is routed to its site (strategies share one
    RecordDict among all their messages, so it is never edited in place)."""
    content = RecordDict({**dict(message.content.items()), protocol.SECAGG_RECORD: ConfigRecord(routed)})
    return Message(content, dst_node_id=message.metadata.dst_node_id, message_type=message.metadata.message_type)


def _unflatten(flat: np.ndarray, arrays: ArrayRecord, names: list[str], dtype: str | None = None) -> ArrayRecord:
    """`flat` cut into `names`' shapes (in `arrays`' dtypes unless `dtype`)."""
    out, offset = {}, 0
    for name in names:
        shape = tuple(arrays[name].shape)
        size = math.prod(shape)
        out[name] = Array(flat[offset:offset + size].reshape(shape).astype(dtype or arrays[name].dtype))
        offset += size
    return ArrayRecord(out)


def _summed_reply(
    template: Message, arrays: dict[str, ArrayRecord], total_weight: int, weighted_by_key: str,
    metrics: Iterable[MetricRecord],
) -> Message:
    """One reply standing for all survivors: their weighted mean delta (or per-coordinate sums), their total
    weight, and the plain mean of each metric every survivor reported (their own weights are secret)."""
    metrics = list(metrics)
    shared = set.intersection(*(set(m) for m in metrics)) if metrics else set()
    means = {key: float(np.mean([m[key] for m in metrics])) for key in sorted(shared)
             if all(not isinstance(m[key], list) for m in metrics)}
    content = RecordDict({**arrays, "metrics": MetricRecord({**means, weighted_by_key: total_weight})})
    return Message(content, reply_to=template)


def _config_bytes(record: ConfigRecord) -> int:
    return config_record_to_proto(record).ByteSize()
