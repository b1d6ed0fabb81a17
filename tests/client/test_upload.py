"""A site's push as `upload_reply` makes it, against a real coordinator on loopback: a first push streams each
chunk once, named as it goes; a push that finds its first chunk at the coordinator resumes and sends only the
rest; the stored reply is the reply, byte for byte."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers import started_coordinator_run

from hydrafl.client.upload import upload_reply
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import CHUNK_BYTES, split_message
from hydrafl.server.transport.grid import CoordinatorGrid

MIB_FLOATS = CHUNK_BYTES // 4


@pytest.fixture
def site(tmp_path):
    """A coordinator with one site and one message for it (a query, so the reply may carry new arrays)."""
    coordinator, grid, [(node, token)] = started_coordinator_run(tmp_path, "a")
    request = Message(
        RecordDict({"config": ConfigRecord({"server-round": 1})}),
        dst_node_id=node.node_id,
        message_type="query.upload",
    )
    request.metadata.group_id = "1"
    [message_id] = grid.push_messages([request])
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    metadata = (("authorization", f"Bearer {token}"),)
    stub = CoordinatorClient(channel)
    assert (
        stub.PullMessage(pb.PullMessageRequest(), metadata=metadata).envelope.message_id
        == message_id
    )
    yield stub, metadata, grid, request, message_id
    channel.close()
    coordinator.stop()


def _reply(request: Message) -> tuple[Message, dict[str, np.ndarray]]:
    """Three arrays: 2.5 MiB of distinct values (3 chunks), 2 MiB of zeros (one chunk twice), one small."""
    arrays = {
        "a": np.arange(MIB_FLOATS * 5 // 2, dtype=np.float32),
        "b": np.zeros(2 * MIB_FLOATS, dtype=np.float32),
        "c": np.full(7, 0.5, dtype=np.float32),
    }
    record = ArrayRecord({name: Array(values) for name, values in arrays.items()})
    reply = Message(
        RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 3})}),
        reply_to=request,
    )
    reply.metadata.__dict__["_message_id"] = "reply-1"
    return reply, arrays


def _stored_equals(grid: CoordinatorGrid, message_id: str, arrays: dict[str, np.ndarray]) -> bool:
    [stored] = grid.pull_messages([message_id])
    record = stored.content["arrays"]
    return sorted(record) == sorted(arrays) and all(
        np.array_equal(record[k].numpy(), v) for k, v in arrays.items()
    )


def test_a_first_push_streams_each_chunk_once_and_the_manifest_names_them_in_order(site):
    stub, metadata, grid, request, message_id = site
    reply, arrays = _reply(request)
    uploaded = upload_reply(stub, metadata, reply, 1, inline_bytes=0)
    assert not uploaded.resumed and not uploaded.duplicate
    assert (uploaded.stored, uploaded.already_present) == (
        5,
        0,
    )  # 3 + one zero chunk + the small one
    assert set(uploaded.seconds) == {"ask", "put", "push"}
    [row] = grid.store.replies_to([message_id])
    named_first, _ = split_message(reply, 1)  # what naming the whole reply before sending gives
    assert _names(pb.Envelope.FromString(row.envelope)) == _names(named_first)
    assert _stored_equals(grid, message_id, arrays)
    again = upload_reply(stub, metadata, reply, 1, inline_bytes=0)
    assert again.resumed and again.duplicate and (again.stored, again.already_present) == (0, 5)


def _names(envelope: pb.Envelope) -> list[list[str]]:
    return [list(tensor.chunk_digests) for record in envelope.arrays for tensor in record.tensors]


def test_a_push_cut_short_resumes_with_only_the_missing_chunks(site):
    stub, metadata, grid, request, message_id = site
    reply, arrays = _reply(request)
    _, chunks = split_message(reply, 1)
    first_two = list(chunks.items())[:2]
    assert (
        stub.PutChunks(iter(first_two), metadata=metadata).stored == 2
    )  # the connection dropped after two
    uploaded = upload_reply(stub, metadata, reply, 1, inline_bytes=0)
    assert uploaded.resumed and not uploaded.duplicate
    assert (uploaded.stored, uploaded.already_present) == (3, 2)
    assert _stored_equals(grid, message_id, arrays)


def test_a_small_reply_goes_in_one_call(site):
    stub, metadata, grid, request, message_id = site
    reply, arrays = _reply(request)
    uploaded = upload_reply(stub, metadata, reply, 1, inline_bytes=16 * CHUNK_BYTES)
    assert (uploaded.stored, uploaded.resumed, uploaded.duplicate) == (5, False, False)
    assert set(uploaded.seconds) == {"total"}
    assert _stored_equals(grid, message_id, arrays)
