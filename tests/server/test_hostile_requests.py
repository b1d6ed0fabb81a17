"""A hostile site against a real coordinator service on loopback: every request it can craft is refused with a
clear status or accepted in a form the round can aggregate, nothing it sends is credited to another site,
and it can neither hold the coordinator's threads nor fill its disk."""

from __future__ import annotations

import logging
import math
import random
import threading
import time

import grpc
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import local_coordinator
from sqlalchemy import delete, select

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import CHUNK_BYTES, SENT, UPLOADED, split_message
from hydrafl.server.tables import Reply
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.limits import SiteLimits, UploadQuota
from hydrafl.server.transport.packs import SLOT_BYTES
from hydrafl.server.transport.replies import LAYOUT_ARRAYS
from hydrafl.updates import InvalidUpdate, check_train_reply

SHAPE = (3, 2)
SERVICE = "/hydrafl.proto.Coordinator/"
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Live:
    """A coordinator with sites a and b, one running run, and a train message to each."""

    def __init__(self, tmp_path, limits: SiteLimits) -> None:
        self.coordinator = local_coordinator(tmp_path, limits=limits)
        self.store = self.coordinator.store
        (site_a, self.token_a), (site_b, self.token_b) = (
            self.store.add_site("a"),
            self.store.add_site("b"),
        )
        self.nodes = site_a.node_id, site_b.node_id
        run = self.store.create_run({"rounds": 1})
        self.store.set_run_status(run.id, "running")
        self.grid = CoordinatorGrid(
            self.store, self.coordinator.blobs, self.coordinator.service, run.id
        )
        self.arrays = ArrayRecord({"w": Array(np.arange(6, dtype=np.float32).reshape(SHAPE))})
        self.requests = {}
        for node in self.nodes:
            request = Message(
                RecordDict({"arrays": self.arrays}), dst_node_id=node, message_type="train"
            )
            request.metadata.group_id = "1"
            [self.requests[node]] = [request]
            [request.metadata.__dict__["_message_id"]] = self.grid.push_messages([request])
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.coordinator.port}")
        self.stub = CoordinatorStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.coordinator.stop()

    def message_id(self, node: int) -> str:
        return self.requests[node].metadata.message_id


@pytest.fixture
def live(tmp_path):
    live = Live(tmp_path, SiteLimits(stream_idle_s=1.0))
    yield live
    live.close()


def _auth(token):
    return (("authorization", f"Bearer {token}"),)


def _reply(request: Message, content: RecordDict) -> tuple[pb.Envelope, dict]:
    reply = Message(content, reply_to=request)
    reply.metadata.__dict__["_message_id"] = "r"
    return split_message(reply, 1)


def _delta(values=None, num_examples=5) -> RecordDict:
    values = np.full(SHAPE, 0.25, dtype=np.float32) if values is None else values
    return RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(values)}),
            "metrics": MetricRecord({"num-examples": num_examples}),
        }
    )


def _upload(stub, token, chunks):
    return stub.PutChunks(
        iter(pb.Chunk(digest=h, data=bytes(d)) for h, d in chunks.items()), metadata=_auth(token)
    )


def _status(call, *args, **kwargs):
    """The status of `call(*args, **kwargs)`: OK, or the code and details of the RpcError it raised."""
    try:
        call(*args, **kwargs)
    except grpc.RpcError as error:
        return error.code(), error.details()
    return grpc.StatusCode.OK, ""


def _drained(call, *args, **kwargs) -> list:
    """Every answer of a server-streaming `call`."""
    return list(call(*args, **kwargs))


def _healthy(live: Live) -> bool:
    stub = health_pb2_grpc.HealthStub(live.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status == 1


def test_garbage_request_bytes_get_invalid_argument_on_every_method(live):
    for method, streaming in (
        ("Join", None),
        ("PullMessage", None),
        ("HasChunks", None),
        ("PushReply", None),
        ("GetChunks", "out"),
        ("PutChunks", "in"),
    ):
        identity = (lambda data: data), (lambda data: data)
        if streaming == "out":
            call = live.channel.unary_stream(SERVICE + method, *identity)
            code, details = _status(_drained, call, b"\xff\xff\xff", metadata=_auth(live.token_a))
        elif streaming == "in":
            call = live.channel.stream_unary(SERVICE + method, *identity)
            code, details = _status(call, iter([b"\xff\xff\xff"]), metadata=_auth(live.token_a))
        else:
            call = live.channel.unary_unary(SERVICE + method, *identity)
            code, details = _status(call, b"\xff\xff\xff", metadata=_auth(live.token_a))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (method, code, details)
        assert "not a valid protobuf message" in details
    assert _healthy(live)


def test_garbage_bytes_to_the_health_service_get_invalid_argument_not_internal(live, caplog):
    check = live.channel.unary_unary(
        "/grpc.health.v1.Health/Check", lambda data: data, lambda data: data
    )
    with caplog.at_level(logging.DEBUG):
        code, details = _status(lambda: check(b"\xff\xff\xff", timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "not a valid protobuf message" in details
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    watch = live.channel.unary_stream(
        "/grpc.health.v1.Health/Watch", lambda data: data, lambda data: data
    )
    code, _ = _status(lambda: list(watch(b"\xff\xff\xff", timeout=5)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert _healthy(live)


def test_only_bearer_tokens_failures_are_audited_and_throttled_per_address(live):
    join = live.stub.Join
    for header in (live.token_a, f"bearer {live.token_a}", "Bearer ", "Bearer forged"):
        code, _ = _status(join, pb.JoinRequest(), metadata=(("authorization", header),))
        assert code == grpc.StatusCode.UNAUTHENTICATED, header
    assert len(live.store.audit_events("auth-failed")) == 4
    for _ in range(SiteLimits().max_auth_failures - 4):
        _status(lambda: join(pb.JoinRequest(), metadata=_auth("forged")))
    code, details = _status(lambda: join(pb.JoinRequest(), metadata=_auth("another guess")))
    assert (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many failed authentications" in details
    )
    events = len(live.store.audit_events("auth-failed")) + len(
        live.store.audit_events("auth-throttled")
    )
    for _ in range(
        50
    ):  # refused before the token is looked up: no audit row, no database work per attempt
        _status(lambda: join(pb.JoinRequest(), metadata=_auth("forged")))
    assert (
        len(live.store.audit_events("auth-failed")) + len(live.store.audit_events("auth-throttled"))
        == events
        == 10
    )
    assert _healthy(live)


def test_a_wrong_token_flood_from_one_address_never_refuses_a_valid_site_beside_it(live):
    """Guessers and an enrolled site share 127.0.0.1 (one NAT, proxy or host): the guessers are throttled, the
    site's calls all go through, and a site enrolled during the flood gets in too."""
    stop = threading.Event()
    refused: list[tuple] = []
    guesses = [0]

    def flood() -> None:
        while not stop.is_set():
            _status(lambda: live.stub.Join(pb.JoinRequest(), metadata=_auth(f"guess-{guesses[0]}")))
            guesses[0] += 1

    flooders = [threading.Thread(target=flood) for _ in range(4)]
    for thread in flooders:
        thread.start()
    try:
        deadline, calls = time.monotonic() + 3, 0
        while guesses[0] < 200 or time.monotonic() < deadline:
            code, details = _status(
                lambda: live.stub.Join(pb.JoinRequest(), metadata=_auth(live.token_a))
            )
            calls += 1
            if code != grpc.StatusCode.OK:
                refused.append((code, details))
        print(
            f"\n{guesses[0]} wrong tokens beside {calls} calls of a valid site: {len(refused)} of them refused"
        )
        _, token_c = live.store.add_site(
            "c"
        )  # known once the enrolled tokens are read again (each second)
        enrolled = time.monotonic()
        while (
            _status(lambda: live.stub.Join(pb.JoinRequest(), metadata=_auth(token_c)))[0]
            != grpc.StatusCode.OK
        ):
            assert time.monotonic() - enrolled < SiteLimits().known_tokens_refresh_s + 1
            time.sleep(0.1)
        code, _ = _status(
            lambda: live.stub.Join(pb.JoinRequest(), metadata=_auth("yet another guess"))
        )
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED  # the guessers stay throttled
    finally:
        stop.set()
        for thread in flooders:
            thread.join()
    assert refused == []
    live.store.revoke_site("c")
    code, _ = _status(lambda: live.stub.Join(pb.JoinRequest(), metadata=_auth(token_c)))
    assert code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )  # revoked: a guesser now
    audited = len(live.store.audit_events("auth-failed")) + len(
        live.store.audit_events("auth-throttled")
    )
    assert (
        audited == SiteLimits().max_auth_failures
    )  # the database work guesses cause stays bounded
    assert _healthy(live)


def test_a_reply_is_credited_to_the_token_s_site_whatever_its_metadata_says(live):
    node_a, node_b = live.nodes
    envelope, chunks = _reply(live.requests[node_a], _delta())
    forged = Message(RecordDict(), reply_to=live.requests[node_b])
    forged.metadata.__dict__["_message_id"] = "forged"
    envelope.metadata = split_message(forged)[
        0
    ].metadata  # claims to be node b answering b's message
    _upload(live.stub, live.token_a, chunks)
    assert (
        live.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
        ).duplicate
        is False
    )
    envelope.metadata = b"\xff not metadata"  # not even a valid encoding: ignored all the same
    assert (
        live.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
        ).duplicate
        is True
    )
    [reply] = live.grid.pull_messages([live.message_id(node_a), live.message_id(node_b)])
    assert not reply.has_error()
    assert (
        reply.metadata.src_node_id == node_a
        and reply.metadata.reply_to_message_id == live.message_id(node_a)
    )
    np.testing.assert_array_equal(
        reply.content["arrays"]["w"].numpy(), np.full(SHAPE, 0.25, dtype=np.float32)
    )
    envelope.reply_to_message_id = live.message_id(node_b)  # answering b's message with a's token
    code, _ = _status(
        lambda: live.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
        )
    )
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert live.store.next_message_for(node_b).message_id == live.message_id(
        node_b
    )  # b's message still open


def _content_with_array(dtype: str) -> bytes:
    smuggled = RecordDict(
        {
            "metrics": MetricRecord({"num-examples": 5}),
            "hidden": ArrayRecord(
                {
                    "w": Array(
                        dtype=dtype,
                        shape=(3, 2),
                        stype="numpy.ndarray",
                        data=np.float32(1).tobytes(),
                    )
                }
            ),
        }
    )
    return recorddict_to_proto(smuggled).SerializeToString()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("array-in-content", "through the manifest"),
        ("object-dtype-in-content", "through the manifest"),
        ("huge-zero-size-dimension", "is not a tensor shape"),
        ("repeated-chunk-declares-gigabytes", "does not fit in shape"),
        ("evaluate-shape-on-train", "ArrayRecord(s) and one MetricRecord"),
        ("nan-metric", "not a finite number"),
        ("no-weight", "must be a number"),
        ("two-array-records", "ArrayRecord(s) and one MetricRecord"),
        ("tensor-not-sent", "not a tensor this site was sent"),
    ],
)
def test_replies_the_round_could_not_aggregate_are_refused_at_the_edge(live, case, reason):
    node_a, node_b = live.nodes
    request = live.requests[node_a]
    content = _delta(num_examples=float("nan") if case == "nan-metric" else 5)
    if case == "no-weight":
        content["metrics"] = MetricRecord({"loss": 1.0})
    if case == "evaluate-shape-on-train":
        del content["arrays"]
    if case == "two-array-records":
        content["more"] = ArrayRecord({"w": Array(np.full(SHAPE, 0.25, dtype=np.float32))})
    if case == "tensor-not-sent":
        content["arrays"] = ArrayRecord({"v": Array(np.zeros(SHAPE, dtype=np.float32))})
    envelope, chunks = _reply(request, content)
    if case in ("array-in-content", "object-dtype-in-content"):
        del envelope.arrays[:]
        envelope.content = _content_with_array("object" if case.startswith("object") else "float32")
    if case == "huge-zero-size-dimension":
        envelope.arrays[0].tensors[0].shape[:] = [0, 10**15]
        envelope.arrays[0].tensors[0].nbytes = 0
        del envelope.arrays[0].tensors[0].chunk_digests[:]
    if case == "repeated-chunk-declares-gigabytes":
        chunk = b"\0" * CHUNK_BYTES
        chunks = {UPLOADED.digest(chunk): chunk}
        tensor = envelope.arrays[0].tensors[0]
        tensor.shape[:] = [
            20 << 10,
            CHUNK_BYTES // 4,
        ]  # 20 GiB of float32, one chunk listed 20,480 times
        tensor.nbytes = 20 << 30
        tensor.chunk_digests[:] = [UPLOADED.digest(chunk)] * (20 << 10)
    if chunks and case != "repeated-chunk-declares-gigabytes":
        _upload(live.stub, live.token_a, chunks)
    started = time.perf_counter()
    code, details = _status(
        lambda: live.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
        )
    )
    refused_s = time.perf_counter() - started
    assert code == grpc.StatusCode.INVALID_ARGUMENT and reason in details, details
    assert refused_s < 2.0
    assert live.store.audit_events("update-rejected")[-1].detail.startswith("INVALID_ARGUMENT")
    [stored] = live.grid.pull_messages(
        [live.message_id(node_a)]
    )  # the round goes on: the site failed, nothing else
    assert stored.has_error() and reason in stored.error.reason
    assert stored.metadata.src_node_id == node_a
    assert live.coordinator.blobs.uploads(node_a).digests() == []  # its pending uploads are deleted
    good, good_chunks = _reply(live.requests[node_b], _delta())
    _upload(live.stub, live.token_b, good_chunks)
    assert (
        live.stub.PushReply(
            pb.PushReplyRequest(envelope=good), metadata=_auth(live.token_b)
        ).duplicate
        is False
    )


def test_an_evaluate_reply_without_metrics_is_refused(live):
    node_a, _ = live.nodes
    request = Message(
        RecordDict({"arrays": live.arrays}), dst_node_id=node_a, message_type="evaluate"
    )
    request.metadata.group_id = "1"
    [request.metadata.__dict__["_message_id"]] = live.grid.push_messages([request])
    envelope, _ = _reply(request, RecordDict())
    code, details = _status(
        lambda: live.stub.PushReply(
            pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
        )
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "one MetricRecord and no arrays" in details


def test_downloads_and_upload_lookups_are_scoped_to_the_site(live):
    node_a, node_b = live.nodes
    envelope_b = pb.Envelope.FromString(live.store.outbound(live.message_id(node_b)).envelope)
    [digest] = envelope_b.arrays[0].tensors[0].chunk_digests
    other = SENT.digest(b"not part of any message")
    code, details = _status(
        lambda: list(
            live.stub.GetChunks(pb.GetChunksRequest(digests=[other]), metadata=_auth(live.token_a))
        )
    )
    assert (
        code == grpc.StatusCode.PERMISSION_DENIED
        and "not part of a message addressed to this site" in details
    )
    repeated = pb.GetChunksRequest(digests=[digest] * 300)
    assert (
        len(list(live.stub.GetChunks(repeated, metadata=_auth(live.token_a)))) == 1
    )  # a's message has the same chunk
    live.store.add_reply(
        live.store.outbound(live.message_id(node_a)),
        pb.Envelope(error_code=1, error_reason="x").SerializeToString(),
    )
    code, _ = _status(
        lambda: list(
            live.stub.GetChunks(pb.GetChunksRequest(digests=[digest]), metadata=_auth(live.token_a))
        )
    )
    assert (
        code == grpc.StatusCode.PERMISSION_DENIED
    )  # a answered its message: nothing left to download
    _, chunks = _reply(live.requests[node_b], _delta())
    _upload(live.stub, live.token_b, chunks)
    assert list(
        live.stub.HasChunks(
            pb.HasChunksRequest(digests=list(chunks)), metadata=_auth(live.token_b)
        ).present
    ) == list(chunks)
    assert not live.stub.HasChunks(
        pb.HasChunksRequest(digests=list(chunks)), metadata=_auth(live.token_a)
    ).present


def test_uploads_beyond_what_the_open_messages_allow_are_refused_and_freed(live):
    node_a, _ = live.nodes
    allowed = int(np.prod(SHAPE)) * 4
    junk = [
        bytes([i]) * (allowed // 2) for i in range(3)
    ]  # each half the quota: the third one is over it
    code, details = _status(
        lambda: _upload(live.stub, live.token_a, {UPLOADED.digest(j): j for j in junk})
    )
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "upload quota exceeded" in details
    assert live.coordinator.blobs.uploads(node_a).digests() == []
    _, chunks = _reply(live.requests[node_a], _delta())
    assert (
        _upload(live.stub, live.token_a, chunks).stored == 1
    )  # within its quota the site uploads as before


def test_tiny_chunks_cannot_fill_the_disk_past_the_chunk_quota(live):
    """Each stored chunk takes a whole pack slot whatever its size, so a site's uploads are bounded in chunks as
    well as bytes: 24 distinct 1-byte chunks fit the 24-byte quota but not its chunk count, and are all freed."""
    node_a, _ = live.nodes
    quota = live.coordinator.service.uploads.quota(node_a)
    assert quota == UploadQuota(24, math.ceil(24 / CHUNK_BYTES) + LAYOUT_ARRAYS)
    tiny = {UPLOADED.digest(bytes([i])): bytes([i]) for i in range(quota.nbytes)}
    code, details = _status(lambda: _upload(live.stub, live.token_a, tiny))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"allow {quota.chunks}" in details, (
        details
    )
    folder = live.coordinator.blobs.uploads(node_a).root
    assert (
        sum(path.stat().st_blocks * 512 for path in folder.rglob("*") if path.is_file())
        < SLOT_BYTES
    )
    assert live.coordinator.blobs.uploads(node_a).digests() == []
    _, chunks = _reply(live.requests[node_a], _delta())
    assert _upload(live.stub, live.token_a, chunks).stored == 1


def test_a_chunk_sent_twice_at_once_is_stored_once_and_freed_with_the_rest(live):
    """The same name twice in one stream used to get two slots; freeing the site's pending uploads erased one and
    the other was found again, outside any quota."""
    node_a, _ = live.nodes
    request = Message(
        RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(CHUNK_BYTES // 4, np.float32))})}),
        dst_node_id=node_a,
        message_type="train",
    )
    request.metadata.group_id = "1"
    live.grid.push_messages([request])
    bad = pb.Chunk(digest=UPLOADED.digest(b"x"), data=b"y")
    sent = []
    for cycle in range(10):
        data = np.full(CHUNK_BYTES // 4, cycle, np.float32).tobytes()
        chunk = pb.Chunk(digest=UPLOADED.digest(data), data=data)
        code, _ = _status(
            live.stub.PutChunks, iter([chunk, chunk, bad]), metadata=_auth(live.token_a)
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        sent.append(chunk.digest)
    assert not live.stub.HasChunks(
        pb.HasChunksRequest(digests=sent), metadata=_auth(live.token_a)
    ).present
    assert live.coordinator.blobs.uploads(node_a).digests() == []
    assert live.coordinator.service.uploads.ledger.pending_bytes(node_a) == 0


def test_a_push_accepted_while_the_same_site_fails_another_upload_keeps_its_chunks(live):
    """A failed upload frees the site's pending chunks; one arriving while a push is being accepted used to delete
    that push's chunks too, leaving an accepted reply the round could not decode."""
    node_a, _ = live.nodes
    uploads = live.coordinator.blobs.uploads(node_a)
    envelope, chunks = _reply(live.requests[node_a], _delta())
    _upload(live.stub, live.token_a, chunks)
    bad = pb.Chunk(
        digest=UPLOADED.digest(b"x"), data=b""
    )  # within the quota the push's chunk leaves
    spoiled = []
    spoiler = threading.Thread(
        target=lambda: spoiled.append(
            _status(lambda: live.stub.PutChunks(iter([bad]), metadata=_auth(live.token_a)))[0]
        )
    )
    sync = uploads.sync

    def sync_while_spoiled() -> (
        None
    ):  # the failing upload reaches its freeing while the push is past its check
        spoiler.start()
        time.sleep(0.3)
        sync()

    uploads.sync = sync_while_spoiled
    pushed = live.stub.PushReply(
        pb.PushReplyRequest(envelope=envelope), metadata=_auth(live.token_a)
    )
    spoiler.join(timeout=10)
    assert not pushed.duplicate and spoiled == [grpc.StatusCode.INVALID_ARGUMENT]
    assert all(uploads.has(digest) for digest in chunks)
    [reply] = live.grid.pull_messages([live.message_id(node_a)])
    assert not reply.has_error() and np.array_equal(
        reply.content["arrays"]["w"].numpy(), _delta()["arrays"]["w"].numpy()
    )


def test_idle_and_flooding_streams_of_one_site_starve_no_one(live):
    """20 upload streams that never send a chunk: 4 are let in, the rest refused at once; the health check and
    the other site answer meanwhile; the idle ones are cancelled after the idle deadline (1 s here)."""
    hold = threading.Event()

    def silent():
        hold.wait(10)
        return
        yield

    results = []

    def open_stream():
        results.append(
            _status(lambda: live.stub.PutChunks(silent(), metadata=_auth(live.token_a), timeout=10))
        )

    threads = [threading.Thread(target=open_stream) for _ in range(20)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    assert _healthy(live)
    assert (
        live.stub.Join(pb.JoinRequest(), metadata=_auth(live.token_b), timeout=2).site_name == "b"
    )
    for thread in threads:
        thread.join(timeout=10)
    elapsed = time.perf_counter() - started
    hold.set()
    codes = sorted(code.name for code, _ in results)
    assert codes.count("RESOURCE_EXHAUSTED") == 16 and codes.count("CANCELLED") == 4, codes
    assert elapsed < 5  # cancelled after ~1 s idle, not after the client's 10 s
    _, chunks = _reply(live.requests[live.nodes[0]], _delta())
    assert _upload(live.stub, live.token_a, chunks).stored == 1


def _mutated_envelope(rng: random.Random, envelope: pb.Envelope) -> pb.Envelope:
    mutant = pb.Envelope()
    mutant.CopyFrom(envelope)
    tensor = mutant.arrays[0].tensors[0]
    choice = rng.randrange(14)
    if choice == 0:
        tensor.shape[:] = [
            rng.choice([-1, 0, 1, 2, 3, 7, 2**40, 2**62]) for _ in range(rng.randrange(5))
        ]
    elif choice == 1:
        tensor.dtype = rng.choice(["float64", "int8", "object", "", "<f4", "bool", "float16"])
    elif choice == 2:
        tensor.nbytes = rng.choice([-1, 0, 23, 25, 2**62])
    elif choice == 3:
        tensor.chunk_digests.append(tensor.chunk_digests[0])
    elif choice == 4:
        tensor.chunk_digests[:] = [
            rng.choice(["", "../" * 20, "0" * 32, "g" * 32, tensor.chunk_digests[0][:31]])
        ]
    elif choice == 5:
        tensor.name = rng.choice(["", "v", "w" * 1000, "w\0"])
    elif choice == 6:
        mutant.arrays.add().CopyFrom(mutant.arrays[0])
    elif choice == 7:
        mutant.arrays[0].key = rng.choice(["", "metrics", "x"])
    elif choice == 8:
        content = bytearray(mutant.content)
        for _ in range(rng.randrange(1, 4)):
            content[rng.randrange(len(content))] = rng.randrange(256)
        mutant.content = bytes(content)
    elif choice == 9:
        mutant.content = _content_with_array(rng.choice(["float32", "object"]))
    elif choice == 10:
        mutant.error_code, mutant.error_reason = rng.choice(
            [(1, "x" * 5000), (0, "reason"), (3, "")]
        )
    elif choice == 11:
        mutant.metadata = bytes(rng.randrange(256) for _ in range(rng.randrange(64)))
    elif choice == 12:
        mutant.reply_to_message_id = rng.choice(["", "nope", mutant.reply_to_message_id + "x"])
    else:
        tensor.shape[:] = [3, 1]
        tensor.nbytes = 12
    return mutant


@pytest.mark.slow
def test_two_thousand_mutated_requests_get_clean_statuses_and_everything_accepted_decodes(live):
    rng = random.Random(7)
    node_a, node_b = live.nodes
    request = live.requests[node_a]
    envelope, chunks = _reply(request, _delta())
    requests = {
        "Join": pb.JoinRequest(),
        "PullMessage": pb.PullMessageRequest(),
        "HasChunks": pb.HasChunksRequest(digests=list(chunks)),
        "PushReply": pb.PushReplyRequest(envelope=envelope),
    }
    statuses: dict[str, int] = {}
    accepted = 0
    for i in range(2000):
        kind = rng.choice(["bytes", "envelope", "envelope", "chunks"])
        with live.store.session() as session, session.begin():  # every push answers a fresh message
            session.execute(delete(Reply))
        if kind == "envelope":
            _upload(live.stub, live.token_a, chunks)
            mutant = _mutated_envelope(rng, envelope)
            code, _ = _status(
                live.stub.PushReply,
                pb.PushReplyRequest(envelope=mutant),
                metadata=_auth(live.token_a),
            )
            if code == grpc.StatusCode.OK:
                accepted += 1
                [reply] = live.grid.pull_messages([live.message_id(node_a)])
                live.grid._pulled.clear()
                if (
                    not reply.has_error()
                ):  # whatever was accepted decodes and either passes or fails the round's check
                    record = next(iter(reply.content.array_records.values()))
                    try:
                        check_train_reply(
                            reply, live.arrays, shapes={name: a.shape for name, a in record.items()}
                        )
                    except InvalidUpdate:
                        pass
        elif kind == "chunks":
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
            digest = rng.choice(
                [UPLOADED.digest(data), UPLOADED.digest(data + b"x"), "zz", "../../etc/passwd"]
            )
            code, _ = _status(_upload, live.stub, live.token_a, {digest: data})
        else:
            method = rng.choice(list(requests))
            raw = bytearray(requests[method].SerializeToString())
            for _ in range(rng.randrange(1, 6)):
                if raw and rng.random() < 0.5:
                    raw[rng.randrange(len(raw))] = rng.randrange(256)
                else:
                    raw.insert(rng.randrange(len(raw) + 1), rng.randrange(256))
            call = live.channel.unary_unary(SERVICE + method, lambda data: data, lambda data: data)
            cut = bytes(raw[: rng.randrange(len(raw) + 1)])
            code, _ = _status(call, cut, metadata=_auth(live.token_a))
        assert code == grpc.StatusCode.OK or code in REFUSALS, (i, kind, code)
        statuses[code.name] = statuses.get(code.name, 0) + 1
    print(f"\nfuzzed 2000 requests: {statuses}; {accepted} pushes accepted")
    assert statuses.get("INVALID_ARGUMENT", 0) > 500 and accepted > 50
    assert _healthy(live)
    with live.store.session() as session, session.begin():
        session.execute(delete(Reply))
    _upload(live.stub, live.token_b, _reply(live.requests[node_b], _delta())[1])
    good, _ = _reply(live.requests[node_b], _delta())
    assert (
        live.stub.PushReply(
            pb.PushReplyRequest(envelope=good), metadata=_auth(live.token_b)
        ).duplicate
        is False
    )
    [reply] = live.grid.pull_messages([live.message_id(node_b)])
    check_train_reply(reply, live.arrays)
    with live.store.session() as session:
        assert [row.node_id for row in session.scalars(select(Reply))] == [node_b]
