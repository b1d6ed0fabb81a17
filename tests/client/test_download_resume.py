"""A download holds one model, not two, and one cut short resumes with what it lacks: tensors already assembled
are kept and their chunks let go; a chunk that failed its check goes, with every tensor built from it."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.client.download import Assembly, Received
from hydrafl.proto.envelope import EnvelopeError, join_message, split_message


def model_message() -> tuple[Message, dict[str, np.ndarray]]:
    """Three tensors of two chunks each (1.2 MB), and a shared chunk: two zero tensors have the same bytes."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 7, SUPERLINK_NODE_ID, 7
    rng = np.random.default_rng(0)
    values = {name: rng.normal(size=(600, 500)).astype(np.float32) for name in ("a", "b", "c")}
    values["z1"] = values["z2"] = np.zeros(1000, dtype=np.float32)
    message = Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in values.items()})}),
                      dst_node_id=12, message_type="train")
    return message, values


def test_a_download_cut_short_resumes_with_only_what_it_lacks_and_lets_assembled_chunks_go():
    message, values = model_message()
    envelope, chunks = split_message(message)
    tensors = {tensor.name: tensor for tensor in envelope.arrays[0].tensors}
    received = Received()
    with Assembly(envelope, received) as assembly:
        assert sorted(assembly.missing()) == sorted(chunks)
        for digest in [*tensors["a"].chunk_digests, tensors["b"].chunk_digests[0]]:
            assembly.add(digest, bytes(chunks[digest]))
    # the connection dropped here: "a" is assembled and its chunks let go; half of "b" is kept
    assert list(received.chunks) == [tensors["b"].chunk_digests[0]] and len(received.arrays) == 1
    received.keep_for(envelope)
    with Assembly(envelope, received) as assembly:
        rest = assembly.missing()
        assert sorted(rest) == sorted(set(chunks) - set(tensors["a"].chunk_digests) - {tensors["b"].chunk_digests[0]})
        for digest in rest:
            assembly.add(digest, bytes(chunks[digest]))
        arrays = assembly.arrays()
    assert received.chunks == {}  # every tensor assembled: no chunk held beside them
    rebuilt = join_message(envelope, received.chunks, verified=True, assembled=arrays).content["arrays"]
    assert all(np.array_equal(rebuilt[name].numpy(), value) for name, value in values.items())


def test_a_chunk_that_fails_its_check_takes_the_tensors_built_from_it_along():
    message, _ = model_message()
    envelope, chunks = split_message(message)
    tensors = {tensor.name: tensor for tensor in envelope.arrays[0].tensors}
    bad = tensors["a"].chunk_digests[1]
    received = Received()
    with pytest.raises(EnvelopeError, match=f"chunk {bad[:12]} fails its XXH3-128 checksum"):
        with Assembly(envelope, received) as assembly:
            for digest in [*tensors["a"].chunk_digests, *tensors["c"].chunk_digests]:
                assembly.add(digest, b"\0" * len(chunks[digest]) if digest == bad else bytes(chunks[digest]))
            assembly.arrays()
    assert list(received.arrays) == [("float32", (600, 500), tuple(tensors["c"].chunk_digests))]
    with Assembly(envelope, received) as assembly:  # the retry asks for "a" again, not for "c"
        assert set(tensors["a"].chunk_digests) <= set(assembly.missing())
        assert not set(tensors["c"].chunk_digests) & set(assembly.missing())
