"""A download fills each tensor's bytes in place and holds one model, not two; one cut short resumes with what it
lacks; a chunk that fails its check is refused at once and never copied in."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.client.download import Assembly, Received, unfilled_bytes
from hydrafl.proto.envelope import EnvelopeError, join_message, split_message


def model_message() -> tuple[Message, dict[str, np.ndarray]]:
    """Three tensors of two chunks each (1.2 MB), and a shared chunk: two zero tensors have the same bytes."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, SUPERLINK_NODE_ID, 7
    rng = np.random.default_rng(0)
    values = {name: rng.normal(size=(600, 500)).astype(np.float32) for name in ("a", "b", "c")}
    values["z1"] = values["z2"] = np.zeros(1000, dtype=np.float32)
    message = Message(
        RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in values.items()})}),
        dst_node_id=12,
        message_type="train",
    )
    return message, values


def test_a_download_cut_short_resumes_with_only_what_it_lacks_into_the_bytes_it_began():
    message, values = model_message()
    envelope, chunks = split_message(message)
    tensors = {tensor.name: tensor for tensor in envelope.arrays[0].tensors}
    received = Received()
    assembly = Assembly(envelope, received)
    assert sorted(assembly.missing()) == sorted(chunks)
    for digest in [*tensors["a"].chunk_digests, tensors["b"].chunk_digests[0]]:
        assembly.add(digest, bytes(chunks[digest]))
    # the connection dropped here: "a" is filled, "b" half; the zero tensors share one filling
    held = {content[2]: filling for content, filling in received.tensors.items()}
    assert len(held) == 4 and not held[tuple(tensors["a"].chunk_digests)].offsets
    assert list(held[tuple(tensors["b"].chunk_digests)].offsets) == [tensors["b"].chunk_digests[1]]
    began = {content: filling.data for content, filling in received.tensors.items()}
    received.keep_for(envelope)
    assembly = Assembly(envelope, received)
    rest = assembly.missing()
    assert sorted(rest) == sorted(
        set(chunks) - set(tensors["a"].chunk_digests) - {tensors["b"].chunk_digests[0]}
    )
    for digest in rest:
        assembly.add(digest, memoryview(bytes(chunks[digest])))  # as gRPC hands them over: views
    arrays = assembly.arrays()
    # one model held: each tensor's Array is the bytes filled from the start, not a copy of them
    assert {id(array.data) for array in arrays.values()} == {id(data) for data in began.values()}
    assert (
        sum(len(data) for data in began.values()) < sum(v.nbytes for v in values.values()) + 5 * 128
    )
    rebuilt = join_message(envelope, {}, verified=True, assembled=arrays).content["arrays"]
    assert all(np.array_equal(rebuilt[name].numpy(), value) for name, value in values.items())


def test_a_message_with_chunks_still_missing_is_refused_by_name():
    message, _ = model_message()
    envelope, chunks = split_message(message)
    first = envelope.arrays[0].tensors[0].chunk_digests[0]
    assembly = Assembly(envelope, Received())
    for digest in chunks:
        if digest != first:
            assembly.add(digest, chunks[digest])
    with pytest.raises(EnvelopeError, match=f"chunk {first[:12]} is missing"):
        assembly.arrays()


def test_a_chunk_that_fails_its_check_is_refused_at_once_and_asked_for_again():
    message, values = model_message()
    envelope, chunks = split_message(message)
    tensors = {tensor.name: tensor for tensor in envelope.arrays[0].tensors}
    bad = tensors["a"].chunk_digests[1]
    received = Received()
    assembly = Assembly(envelope, received)
    for digest in [*tensors["c"].chunk_digests, tensors["a"].chunk_digests[0]]:
        assembly.add(digest, chunks[digest])
    with pytest.raises(EnvelopeError, match=f"chunk {bad[:12]} fails its XXH3-128 checksum"):
        assembly.add(bad, b"\0" * len(chunks[bad]))
    received.keep_for(envelope)
    assembly = Assembly(envelope, received)  # the retry asks for that chunk again, not for "c"
    assert bad in assembly.missing() and tensors["a"].chunk_digests[0] not in assembly.missing()
    assert not set(tensors["c"].chunk_digests) & set(assembly.missing())
    for digest in assembly.missing():
        assembly.add(digest, chunks[digest])
    rebuilt = join_message(envelope, {}, verified=True, assembled=assembly.arrays()).content[
        "arrays"
    ]
    assert np.array_equal(rebuilt["a"].numpy(), values["a"])  # no zero from the refused chunk


def test_unfilled_bytes_are_new_bytes_that_show_what_was_written_into_them():
    first, view = unfilled_bytes(10)
    second, _ = unfilled_bytes(10)
    view[:] = b"0123456789"
    assert type(first) is bytes and first == b"0123456789" and first is not second
    assert hash(first) == hash(b"0123456789")


def test_the_view_of_unfilled_bytes_keeps_them_alive():
    """Writing through a view whose bytes were freed would write into whatever took their memory."""
    data, view = unfilled_bytes(64)
    held = sys.getrefcount(data)
    del view
    assert sys.getrefcount(data) == held - 1
