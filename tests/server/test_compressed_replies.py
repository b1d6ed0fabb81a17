"""The coordinator's edge check of compressed train replies: held to the exact layout of the scheme the
coordinator sent (never the reply's own say), over tensors it sent, with values that decode to finite numbers;
and a compressed reply travels through the coordinator and is decoded by the round driver."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity
from helpers import local_coordinator

from hydrafl.arrays import from_record
from hydrafl.compression.downloads import DownloadCompression
from hydrafl.compression.feedback import ErrorFeedback
from hydrafl.compression.layout import RECORD, Scheme
from hydrafl.compression.receive import decode_reply
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import EnvelopeError, split_message
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.replies import allowed_reply_bytes, check_reply

SENT = {"w": np.ones((64, 32), dtype=np.float32), "b": np.ones(32, dtype=np.float32)}


def _request(config: dict, node_id: int = 1) -> Message:
    content = RecordDict(
        {
            "arrays": ArrayRecord({n: Array(a) for n, a in SENT.items()}),
            "config": ConfigRecord(config),
        }
    )
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    message = Message(content, dst_node_id=node_id, message_type="train")
    message.metadata.group_id = "1"
    message.metadata.__dict__["_message_id"] = "m-1"
    return message


def _update() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(array.shape, generator=generator) for name, array in SENT.items()}


def _compressed_reply(request: Message, scheme: Scheme) -> Message:
    arrays, description = ErrorFeedback("k", {}, {}).compress(_update(), scheme)
    content = RecordDict(
        {"arrays": arrays, "metrics": MetricRecord({"num-examples": 5}), RECORD: description}
    )
    reply = Message(content, reply_to=request)
    reply.metadata.__dict__["_message_id"] = "r-1"
    return reply


def _check(reply: Message, request: Message) -> None:
    sent, _ = split_message(request, 1)
    envelope, chunks = split_message(reply, 1)
    check_reply(
        envelope,
        sent,
        chunk_size=lambda d: len(chunks[d]),
        chunk_bytes=lambda d: bytes(chunks[d]),
        weighted_by_key="num-examples",
        max_model_bytes=1 << 30,
    )


def _config(name: str) -> dict:
    return {
        "compress": name,
        "compress-topk-fraction": 0.05,
        "compress-rank": 4,
        "compress-block": 256,
    }


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "topk", "powersgd"])
def test_a_reply_in_the_scheme_sent_is_accepted(name):
    request = _request(_config(name))
    _check(_compressed_reply(request, Scheme.from_config(_config(name))), request)


def _tampered(case: str) -> tuple[Message, Message]:
    request = _request(_config("topk"))
    scheme = Scheme.from_config(_config("topk"))
    if case == "other-scheme":
        return _compressed_reply(request, Scheme(name="int8")), request
    if case == "not-asked":
        return _compressed_reply(request, scheme), _request({"compress": "none"})
    if case == "other-fraction":
        return _compressed_reply(request, Scheme(name="topk", topk_fraction=0.1)), request
    if (
        case == "nan-bits"
    ):  # a site's own decoding refuses to send Inf: a hostile site sends the bits anyway
        request = _request(_config("bf16"))
        reply = _compressed_reply(request, Scheme(name="bf16"))
        bits = from_record(reply.content["arrays"])["compress.bf16"].numpy().copy()
        bits[3] = 0x7F80  # bfloat16 +Inf
        reply.content["arrays"]["compress.bf16"] = Array(bits)
        return reply, request
    reply = _compressed_reply(request, scheme)
    description = reply.content[RECORD]
    if case == "unsent-tensor":
        description["names"] = ["w", "x"]
    elif case == "wider":
        description["dims"] = [64, 33, 32]
    elif case == "index":
        index = from_record(reply.content["arrays"])["compress.index"].numpy().copy()
        index[0] = 64 * 32 + 32
        reply.content["arrays"]["compress.index"] = Array(index)
    elif case == "extra-array":
        reply.content["arrays"]["w"] = Array(SENT["w"])
    return reply, request


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("other-scheme", "compressed with 'int8'; this run uses 'topk'"),
        ("not-asked", "asked for no compression"),
        ("other-fraction", "expected int32"),
        ("unsent-tensor", "'x' of shape [32] is not (a slice of) a float32 tensor sent"),
        ("wider", "'w' of shape [64, 33] is not"),
        ("index", "index outside the update's 2080 coordinates"),
        ("nan-bits", "NaN or Inf"),
        ("extra-array", "holds arrays"),
    ],
)
def test_a_reply_off_the_scheme_is_refused_with_the_reason(case, reason):
    reply, request = _tampered(case)
    with pytest.raises(EnvelopeError, match="compressed update") as raised:
        _check(reply, request)
    assert reason in str(raised.value)


def test_a_compressed_reply_is_accepted_by_the_coordinator_and_decoded_for_the_strategy(tmp_path):
    coordinator = local_coordinator(tmp_path)
    channel = grpc.insecure_channel(f"127.0.0.1:{coordinator.port}")
    try:
        site, token = coordinator.store.add_site("a")
        run = coordinator.store.create_run({"rounds": 1})
        coordinator.store.set_run_status(run.id, "running")
        grid = CoordinatorGrid(coordinator.store, coordinator.blobs, coordinator.service, run.id)
        request = _request(_config("powersgd"), site.node_id)
        [message_id] = grid.push_messages([request])
        stub, auth = CoordinatorStub(channel), (("authorization", f"Bearer {token}"),)
        pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=auth)
        assert pulled.has_message and pulled.envelope.message_id == message_id
        request.metadata.__dict__["_message_id"] = message_id
        envelope, chunks = split_message(_compressed_reply(request, Scheme(name="powersgd")), 1)
        stub.PutChunks(
            iter(pb.Chunk(digest=d, data=bytes(c)) for d, c in chunks.items()), metadata=auth
        )
        assert (
            stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=auth).duplicate is False
        )
        [reply] = grid.pull_messages([message_id])
        decoded = from_record(decode_reply(reply, Scheme(name="powersgd")).content["arrays"])
        assert {n: tuple(t.shape) for n, t in decoded.items()} == {"w": (64, 32), "b": (32,)}
        assert torch.equal(decoded["b"], _update()["b"])  # vectors travel whole
    finally:
        channel.close()
        coordinator.stop()


@pytest.mark.parametrize("name", ["int8", "topk"])
def test_a_reply_to_a_compressed_download_is_held_to_the_model_it_changes(name):
    """The message carries packed changes, not the model: the reply is checked against (and may be as large as)
    the float32 tensors its download record declares."""
    config = {**_config(name), "compress-downloads": True}
    downloads = DownloadCompression.from_config(config)
    [whole] = downloads.prepare([_request(config)], 1)
    answered = Message(RecordDict({"metrics": MetricRecord({"num-examples": 5})}), reply_to=whole)
    answered.metadata.__dict__["_src_node_id"] = 1
    assert len(list(downloads.settle([whole], [answered]))) == 1
    [delta] = downloads.prepare([_request(config)], 2)
    sent, _ = split_message(delta, 2)
    assert {t.name for record in sent.arrays for t in record.tensors}.isdisjoint(
        SENT
    )  # packed, not the model
    assert allowed_reply_bytes(sent, 0) == sum(array.nbytes for array in SENT.values())
    delta.metadata.__dict__["_message_id"] = "m-2"
    _check(_compressed_reply(delta, Scheme.from_config(config)), delta)
    plain = Message(
        RecordDict(
            {
                "arrays": ArrayRecord({n: Array(a) for n, a in SENT.items()}),
                "metrics": MetricRecord({"num-examples": 5}),
            }
        ),
        reply_to=delta,
    )
    plain.metadata.__dict__["_message_id"] = "r-2"
    _check(plain, delta)
    wider = Message(
        RecordDict(
            {
                "arrays": ArrayRecord({"w": Array(np.ones((65, 32), dtype=np.float32))}),
                "metrics": MetricRecord({"num-examples": 5}),
            }
        ),
        reply_to=delta,
    )
    wider.metadata.__dict__["_message_id"] = "r-3"
    with pytest.raises(EnvelopeError, match="does not fit in shape"):
        _check(wider, delta)
