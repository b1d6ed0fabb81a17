"""Secure-aggregation replies against a real coordinator service on loopback: a malformed share, a share for
a site outside the round, or a masked vector of the wrong kind is refused with INVALID_ARGUMENT before it is
stored (the round sees that site failed); a well-formed one is accepted."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers import local_coordinator

from hydrafl import protocol
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import split_message
from hydrafl.secagg import wire
from hydrafl.secagg.site import SEALED_BYTES, SignedKeys
from hydrafl.server.transport.grid import CoordinatorGrid

KEY = SignedKeys(bytes(32), bytes(32), bytes(32), bytes(32), bytes(64), bytes(64))


class Live:
    """A coordinator with sites a and b in one running run; `push` sends each a message of one kind."""

    def __init__(self, tmp_path) -> None:
        self.coordinator = local_coordinator(tmp_path)
        store = self.coordinator.store
        (site_a, token_a), (site_b, token_b) = store.add_site("a"), store.add_site("b")
        self.nodes, self.tokens = (
            (site_a.node_id, site_b.node_id),
            {site_a.node_id: token_a, site_b.node_id: token_b},
        )
        run = store.create_run({"rounds": 1})
        store.set_run_status(run.id, "running")
        self.grid = CoordinatorGrid(store, self.coordinator.blobs, self.coordinator.service, run.id)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.coordinator.port}")
        self.stub = CoordinatorStub(self.channel)

    def push(self, kind: str, content_for) -> dict[int, Message]:
        requests = {}
        for node in self.nodes:
            request = Message(content_for(node), dst_node_id=node, message_type=kind)
            request.metadata.group_id = "1"
            [request.metadata.__dict__["_message_id"]] = self.grid.push_messages([request])
            requests[node] = request
        return requests

    def answer(self, request: Message, content: RecordDict) -> grpc.StatusCode:
        reply = Message(content, reply_to=request)
        reply.metadata.__dict__["_message_id"] = "r"
        envelope, chunks = split_message(reply, 1)
        token = (("authorization", f"Bearer {self.tokens[request.metadata.dst_node_id]}"),)
        self.stub.PutChunks(
            iter(pb.Chunk(digest=h, data=bytes(d)) for h, d in chunks.items()), metadata=token
        )
        try:
            self.stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=token)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def close(self) -> None:
        self.channel.close()
        self.coordinator.stop()


@pytest.fixture
def live(tmp_path):
    live = Live(tmp_path)
    yield live
    live.close()


def _secagg(record: dict) -> RecordDict:
    return RecordDict({protocol.SECAGG_RECORD: ConfigRecord(record)})


def test_shares_for_another_site_or_malformed_are_refused_and_a_good_reply_accepted(live):
    a, b = live.nodes
    keys = {a: KEY, b: KEY, 77: KEY}
    requests = live.push(
        protocol.QUERY_SECAGG_SHARES, lambda node: _secagg(wire.shares_request(node, keys))
    )
    neighbours = lambda node: sorted(set(keys) - {node})  # noqa: E731
    stranger = {n: bytes(SEALED_BYTES) for n in [*neighbours(a), 999]}
    assert (
        live.answer(requests[a], _secagg(wire.sealed_record(stranger)))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    good = {n: bytes(SEALED_BYTES) for n in neighbours(b)}
    assert live.answer(
        requests[b], _secagg(wire.sealed_record({**good, b: bytes(SEALED_BYTES)}))
    ) == (grpc.StatusCode.INVALID_ARGUMENT)  # a share addressed to itself
    replies = {
        r.metadata.src_node_id: r
        for r in live.grid.pull_messages([m.metadata.message_id for m in requests.values()])
    }
    assert (
        replies[a].has_error() and "addressed to" in replies[a].error.reason
    )  # stored as a failure, not content
    assert replies[b].has_error()


def test_a_short_share_is_refused(live):
    a, b = live.nodes
    keys = {a: KEY, b: KEY}
    requests = live.push(
        protocol.QUERY_SECAGG_SHARES, lambda node: _secagg(wire.shares_request(node, keys))
    )
    assert live.answer(requests[a], _secagg(wire.sealed_record({b: bytes(SEALED_BYTES - 1)}))) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (
        live.answer(requests[b], _secagg(wire.sealed_record({a: bytes(SEALED_BYTES)})))
        == grpc.StatusCode.OK
    )


@pytest.mark.parametrize("kind", ["train", "evaluate"])
def test_a_masked_vector_must_be_uint32_of_the_rounds_length_with_nothing_in_the_clear(live, kind):
    """Train and evaluate replies of a secure round: the one masked vector, and no metric, count or hash in the
    clear (the weight and the metrics are inside the sum)."""
    a, b = live.nodes
    arrays = ArrayRecord({"w": Array(np.zeros((3, 2), dtype=np.float32))})

    def routed(node: int) -> RecordDict:
        secagg = ConfigRecord({**wire.sealed_record({}), "length": 7})
        return RecordDict({"arrays": arrays, protocol.SECAGG_RECORD: secagg})

    requests = live.push(kind, routed)
    if kind == "train":
        plain = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 5})})
    else:
        plain = RecordDict(
            {"metrics": MetricRecord({"num-examples": 5, "loss": 0.3, "accuracy": 0.5})}
        )
    assert (
        live.answer(requests[a], plain) == grpc.StatusCode.INVALID_ARGUMENT
    )  # the site's values in the clear
    vector = ArrayRecord({protocol.SECAGG_MASKED: Array(np.arange(7, dtype=np.uint32))})
    assert live.answer(requests[b], RecordDict({"arrays": vector})) == grpc.StatusCode.OK
    requests = live.push(kind, routed)
    with_metric = RecordDict({"arrays": vector, "metrics": MetricRecord({"train_loss": 0.5})})
    assert (
        live.answer(requests[a], with_metric) == grpc.StatusCode.INVALID_ARGUMENT
    )  # one metric in the clear
    with_hash = RecordDict(
        {"arrays": vector, "train-info": ConfigRecord({protocol.DATA_HASH: "abc"})}
    )
    assert live.answer(requests[b], with_hash) == grpc.StatusCode.INVALID_ARGUMENT


def test_key_material_and_survivor_signatures_of_the_wrong_size_are_refused(live):
    a, b = live.nodes
    requests = live.push(protocol.QUERY_SECAGG_KEYS, lambda node: _secagg({"round": 1}))
    short = {**wire.keys_reply(KEY), "signature": bytes(63)}
    assert live.answer(requests[a], _secagg(short)) == grpc.StatusCode.INVALID_ARGUMENT
    assert live.answer(requests[b], _secagg(wire.keys_reply(KEY))) == grpc.StatusCode.OK
    requests = live.push(
        protocol.QUERY_SECAGG_CHECK, lambda node: _secagg(wire.check_request([a, b]))
    )
    assert (
        live.answer(requests[a], _secagg(wire.check_reply(bytes(65))))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert live.answer(requests[b], _secagg(wire.check_reply(bytes(64)))) == grpc.StatusCode.OK
