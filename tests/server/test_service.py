"""Every bad input gets a clear gRPC status and changes nothing; the coordinator keeps serving."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from helpers import started_coordinator_run
from sqlalchemy import func, select

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import CHUNK_BYTES, INLINE_BYTES, UPLOADED, split_message
from hydrafl.server.tables import Reply
from hydrafl.server.transport.grid import CoordinatorGrid


@pytest.fixture
def live(tmp_path):
    coordinator, grid, [(site_a, token_a), (_, token_b)] = started_coordinator_run(
        tmp_path, "a", "b"
    )
    arrays = ArrayRecord({"w": Array(np.ones((3, 2), dtype=np.float32))})
    request = Message(
        RecordDict({"arrays": arrays}), dst_node_id=site_a.node_id, message_type="train"
    )
    request.metadata.group_id = "1"
    [message_id] = grid.push_messages([request])
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    yield coordinator, CoordinatorStub(channel), token_a, token_b, message_id, request
    channel.close()
    coordinator.stop()


def _auth(token):
    return (("authorization", f"Bearer {token}"),)


def _reply(request, values):
    reply = Message(
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(values)}),
                "metrics": MetricRecord({"num-examples": 5}),
            }
        ),
        reply_to=request,
    )
    reply.metadata.__dict__["_message_id"] = "r-1"
    return split_message(reply, 1)


def _upload(stub, token, chunks):
    stub.PutChunks(
        iter(pb.Chunk(digest=h, data=bytes(d)) for h, d in chunks.items()), metadata=_auth(token)
    )


def _code(call):
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value.code(), raised.value.details()


def _replies(coordinator):
    with coordinator.store.session() as session:
        return session.scalar(select(func.count()).select_from(Reply))


def _accepted_updates(coordinator):
    """Stored replies that carry content (a refused reply is stored as the site's error reply)."""
    with coordinator.store.session() as session:
        envelopes = [pb.Envelope.FromString(row.envelope) for row in session.scalars(select(Reply))]
    return sum(1 for envelope in envelopes if not envelope.error_reason)


def test_tokens(live):
    coordinator, stub, token_a, token_b, _, _ = live
    assert stub.Join(pb.JoinRequest(), metadata=_auth(token_a)).site_name == "a"
    assert (
        _code(lambda: stub.Join(pb.JoinRequest(), metadata=_auth("forged")))[0]
        == grpc.StatusCode.UNAUTHENTICATED
    )
    assert _code(lambda: stub.Join(pb.JoinRequest()))[0] == grpc.StatusCode.UNAUTHENTICATED
    coordinator.store.revoke_site("b")
    assert _code(lambda: stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_b)))[0] == (
        grpc.StatusCode.UNAUTHENTICATED
    )


def test_a_valid_reply_is_accepted_once(live):
    coordinator, stub, token_a, _, message_id, request = live
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_a))
    assert pulled.has_message and pulled.envelope.message_id == message_id
    envelope, chunks = _reply(request, np.zeros((3, 2), dtype=np.float32))
    _upload(stub, token_a, chunks)
    present = stub.HasChunks(
        pb.HasChunksRequest(digests=list(chunks)), metadata=_auth(token_a)
    ).present
    assert set(present) == set(chunks)
    assert (
        stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=_auth(token_a)).duplicate
        is False
    )
    assert (
        stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=_auth(token_a)).duplicate
        is True
    )
    assert _replies(coordinator) == 1
    assert not stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_a)).has_message


def test_a_small_message_and_its_reply_carry_their_chunks_inline(live):
    """One call each way for a small model: PullMessage brings the message's chunks, PushReply takes the reply's;
    the inline chunks are checked and counted as streamed ones are."""
    coordinator, stub, token_a, _, _, request = live
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_a))
    [digest] = [
        d
        for record in pulled.envelope.arrays
        for tensor in record.tensors
        for d in tensor.chunk_digests
    ]
    assert [chunk.digest for chunk in pulled.chunks] == [digest]
    assert np.array_equal(
        np.frombuffer(pulled.chunks[0].data, dtype=np.float32), np.ones(6, dtype=np.float32)
    )
    envelope, chunks = _reply(request, np.full((3, 2), 0.25, dtype=np.float32))
    inline = [pb.Chunk(digest=h, data=bytes(d)) for h, d in chunks.items()]
    tampered = [
        pb.Chunk(digest=c.digest, data=c.data[:-4] + b"\x00\x00\x80\x7f") for c in inline
    ]  # a NaN
    code, details = _code(
        lambda: stub.PushReply(
            pb.PushReplyRequest(envelope=envelope, chunks=tampered), metadata=_auth(token_a)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fails its XXH3-128 check" in details
    assert _replies(coordinator) == 0
    assert (
        stub.PushReply(
            pb.PushReplyRequest(envelope=envelope, chunks=inline), metadata=_auth(token_a)
        ).duplicate
        is False
    )
    # pushed again (its answer lost on the way): a duplicate, as a streamed push is, not a refused upload
    assert (
        stub.PushReply(
            pb.PushReplyRequest(envelope=envelope, chunks=inline), metadata=_auth(token_a)
        ).duplicate
        is True
    )
    [reply] = coordinator.store.replies_to([request.metadata.message_id])
    stored = pb.Envelope.FromString(reply.envelope)
    [[stored_digest]] = [
        tensor.chunk_digests
        for record in stored.arrays
        for tensor in record.tensors
        if tensor.name == "w"
    ]
    stored_bytes = coordinator.blobs.uploads(reply.node_id).get(stored_digest)
    assert np.array_equal(
        np.frombuffer(stored_bytes, dtype=np.float32), np.full(6, 0.25, dtype=np.float32)
    )


def test_a_message_over_the_inline_size_sends_no_chunks_with_it(live):
    coordinator, stub, token_a, _, message_id, _ = live
    coordinator.store.close_messages(
        [message_id]
    )  # the fixture's small message is no longer in the way
    site = coordinator.store.sites()[0]
    grid = CoordinatorGrid(coordinator.store, coordinator.blobs, coordinator.service, 1)
    big = np.arange(
        INLINE_BYTES // 4 + 1, dtype=np.float32
    )  # distinct chunks: over the inline size
    request = Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(big)})}),
        dst_node_id=site.node_id,
        message_type="evaluate",
    )
    request.metadata.group_id = "1"
    grid.push_messages([request])
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_a))
    assert pulled.has_message and pulled.envelope.message_type == "evaluate" and not pulled.chunks


def test_a_reply_may_carry_a_slice_of_a_tensor_it_was_sent(live):
    """A Hydra-net site uploads only the rows/columns it trained; the strategy checks which."""
    coordinator, stub, token_a, _, _, request = live
    envelope, chunks = _reply(request, np.ones((3, 1), dtype=np.float32))
    _upload(stub, token_a, chunks)
    assert (
        stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=_auth(token_a)).duplicate
        is False
    )
    assert _replies(coordinator) == 1


@pytest.mark.parametrize(
    ("case", "code", "reason"),
    [
        ("other-site", grpc.StatusCode.PERMISSION_DENIED, "not addressed to this site"),
        ("nan", grpc.StatusCode.INVALID_ARGUMENT, "NaN or Inf"),
        ("not-uploaded", grpc.StatusCode.INVALID_ARGUMENT, "was not uploaded"),
        ("shape", grpc.StatusCode.INVALID_ARGUMENT, "does not fit in shape [3, 2]"),
        ("wider", grpc.StatusCode.INVALID_ARGUMENT, "shape [3, 4] float32 does not fit"),
        ("garbage", grpc.StatusCode.INVALID_ARGUMENT, "not a valid Flower RecordDict"),
        ("finished-run", grpc.StatusCode.FAILED_PRECONDITION, "is not running"),
    ],
)
def test_bad_replies_get_a_clear_status_and_change_nothing(live, case, code, reason):
    coordinator, stub, token_a, token_b, _, request = live
    values = np.full(
        (3, 4 if case == "wider" else 2), np.nan if case == "nan" else 0.5, dtype=np.float32
    )
    envelope, chunks = _reply(request, values)
    token = token_b if case == "other-site" else token_a
    if case not in (
        "not-uploaded",
        "other-site",
        "wider",
    ):  # a wider tensor is over the upload quota too
        _upload(stub, token, chunks)
    if case == "shape":
        envelope.arrays[0].tensors[0].shape[:] = [2, 3, 1]
    if case == "garbage":
        envelope.content = b"\x00\xffnot protobuf"
    if case == "finished-run":
        coordinator.store.set_run_status(envelope.run_id or 1, "finished")
    got, details = _code(
        lambda: stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=_auth(token))
    )
    assert got == code and reason in details
    assert _accepted_updates(coordinator) == 0
    assert coordinator.store.audit_events("update-rejected")[-1].detail.startswith(code.name)
    assert stub.Join(pb.JoinRequest(), metadata=_auth(token_a)).site_name == "a"  # still serving


def test_a_chunk_that_does_not_match_its_hash_or_is_oversize_is_refused(live):
    coordinator, stub, token_a, _, _, _ = live
    bad = iter([pb.Chunk(digest="ab" * 16, data=b"payload")])
    code, details = _code(lambda: stub.PutChunks(bad, metadata=_auth(token_a)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "fails its XXH3-128 check" in details
    assert not list(coordinator.blobs.root.rglob("ab" * 16))
    code, details = _code(
        lambda: stub.PutChunks(
            iter([pb.Chunk(digest="ab" * 32, data=b"payload")]), metadata=_auth(token_a)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a XXH3-128 hex digest" in details
    data = b"x" * (CHUNK_BYTES + 1)
    oversize = pb.Chunk(digest=UPLOADED.digest(data), data=data)
    code, details = _code(lambda: stub.PutChunks(iter([oversize]), metadata=_auth(token_a)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most" in details
    assert not list(coordinator.blobs.root.rglob(UPLOADED.digest(data)))


def test_a_reply_after_the_round_deadline_is_refused(live):
    coordinator, stub, token_a, _, message_id, request = live
    coordinator.store.close_messages([message_id])
    assert not stub.PullMessage(pb.PullMessageRequest(), metadata=_auth(token_a)).has_message
    envelope, chunks = _reply(request, np.zeros((3, 2), dtype=np.float32))
    code, details = _code(lambda: _upload(stub, token_a, chunks))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "takes an upload" in details
    code, details = _code(
        lambda: stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=_auth(token_a))
    )
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "late reply refused" in details
    assert _replies(coordinator) == 0
