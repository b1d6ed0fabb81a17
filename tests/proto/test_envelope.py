"""Messages survive the envelope + chunk form exactly, and malformed envelopes are refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    SENT,
    XXH3,
    EnvelopeError,
    check_manifest,
    chunk_hashes,
    join_message,
    split_message,
)


def _message() -> Message:
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, SUPERLINK_NODE_ID, 7
    rng = np.random.default_rng(0)
    arrays = ArrayRecord(
        {
            "big": Array(rng.normal(size=(600, 500)).astype(np.float32)),  # 1.2 MB: two chunks
            "small": Array(np.arange(6, dtype=np.int64).reshape(2, 3)),
            "same": Array(np.zeros(10, dtype=np.float32)),
            "twin": Array(np.zeros(10, dtype=np.float32)),
        }
    )
    content = RecordDict(
        {"arrays": arrays, "config": ConfigRecord({"lr": 0.1}), "metrics": MetricRecord({"n": 3})}
    )
    message = Message(content, dst_node_id=12, message_type="train", group_id="4")
    message.metadata.__dict__["_message_id"] = "m-1"
    return message


def test_chunks_are_views_of_the_message_and_any_memory_order_round_trips():
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, SUPERLINK_NODE_ID, 7
    values = np.arange(3 * 400_000, dtype=np.float32).reshape(3, 400_000)
    record = ArrayRecord({"c": Array(values), "f": Array(np.asfortranarray(values))})
    message = Message(RecordDict({"arrays": record}), dst_node_id=12, message_type="train")
    envelope, chunks = split_message(message)
    c, f = envelope.arrays[0].tensors
    assert (
        c.chunk_digests == f.chunk_digests
    )  # the same values in C order, whatever the memory layout
    assert all(isinstance(piece, memoryview) for piece in chunks.values())
    assert bytes(chunks[c.chunk_digests[0]]) == values.tobytes()[:CHUNK_BYTES]
    rebuilt = join_message(envelope, chunks)
    np.testing.assert_array_equal(rebuilt.content["arrays"]["f"].numpy(), values)


def test_round_trip_is_exact_and_chunks_are_content_addressed():
    message = _message()
    envelope, chunks = split_message(message, server_round=4)
    assert envelope.round == 4 and envelope.message_type == "train"
    big = envelope.arrays[0].tensors[0]
    assert big.nbytes == 600 * 500 * 4 and len(big.chunk_digests) == 2
    assert all(len(piece) <= CHUNK_BYTES and SENT.digest(piece) == h for h, piece in chunks.items())
    assert len(chunks) == 4  # "same" and "twin" share one chunk
    assert set(chunk_hashes(envelope)) == set(chunks)
    rebuilt = join_message(envelope, chunks)
    assert rebuilt.metadata.message_id == "m-1" and rebuilt.metadata.dst_node_id == 12
    assert rebuilt.metadata.group_id == "4"
    for name, array in message.content["arrays"].items():
        np.testing.assert_array_equal(rebuilt.content["arrays"][name].numpy(), array.numpy())
        assert rebuilt.content["arrays"][name].dtype == array.dtype
    assert rebuilt.content["config"]["lr"] == 0.1 and rebuilt.content["metrics"]["n"] == 3


def test_error_replies_travel_without_content():
    request = _message()
    reply = Message(Error(2, "ValueError: bad site data"), reply_to=request)
    envelope, chunks = split_message(reply)
    assert chunks == {}
    rebuilt = join_message(envelope, {})
    assert rebuilt.has_error() and rebuilt.error.reason == "ValueError: bad site data"


def _drop_checksums(envelope) -> None:
    for tensor in envelope.arrays[0].tensors:
        del tensor.chunk_checksums[:]


def test_the_coordinators_manifest_lists_each_chunks_checksum_and_a_reply_none():
    envelope, chunks = split_message(_message())
    big = envelope.arrays[0].tensors[0]
    assert list(big.chunk_checksums) == [
        XXH3.digest(chunks[digest]) for digest in big.chunk_digests
    ]
    reply, _ = split_message(Message(_message().content, reply_to=_message()))
    assert all(not tensor.chunk_checksums for tensor in reply.arrays[0].tensors)
    reply.arrays[0].tensors[0].chunk_checksums.extend(big.chunk_checksums)
    with pytest.raises(EnvelopeError, match="a reply's chunks are named by their checksum"):
        check_manifest(reply)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (lambda env, chunks: chunks.pop(env.arrays[0].tensors[0].chunk_digests[1]), "is missing"),
        (
            lambda env, chunks: chunks.update(
                {env.arrays[0].tensors[1].chunk_digests[0]: b"x" * 48}
            ),
            "fails its XXH3-128 checksum",
        ),
        (
            lambda env, chunks: (
                _drop_checksums(env)
                or chunks.update({env.arrays[0].tensors[1].chunk_digests[0]: b"x" * 48})
            ),
            "fails its BLAKE3 check",
        ),  # a manifest from before checksums: its chunks are checked against their names
        (
            lambda env, chunks: env.arrays[0].tensors[0].chunk_checksums.pop(),
            "1 checksums for 2 chunks",
        ),
        (
            lambda env, chunks: env.arrays[0].tensors[1].chunk_checksums.__setitem__(0, "zz" * 16),
            "is not an XXH3-128",
        ),
        (
            lambda env, chunks: env.arrays[0].tensors[3].chunk_checksums.__setitem__(0, "0" * 32),
            "listed with two different checksums",
        ),  # "same" and "twin": one chunk
        (lambda env, chunks: env.arrays[0].tensors[1].shape.append(2), "does not match shape"),
        (
            lambda env, chunks: setattr(env.arrays[0].tensors[1], "dtype", "object"),
            "dtype 'object' is not allowed",
        ),
        (lambda env, chunks: env.arrays[0].tensors[0].chunk_digests.pop(), "chunks listed"),
        (
            lambda env, chunks: setattr(env, "content", b"\xff\x00garbage"),
            "not a valid Flower RecordDict",
        ),
    ],
)
def test_malformed_envelopes_are_refused_with_the_reason(corrupt, reason):
    envelope, chunks = split_message(_message())
    corrupt(envelope, chunks)
    with pytest.raises(EnvelopeError, match=reason):
        join_message(envelope, chunks)
