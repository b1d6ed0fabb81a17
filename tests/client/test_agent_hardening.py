"""A site trusts its coordinator no more than it must: a hostile coordinator (a real gRPC server on loopback)
gets an error reply for each bad message, and the real SiteAgent keeps serving the next, valid one."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from dicom_files import pattern_folder
from fake_coordinator import FakeCoordinator, coordinator_message, run_config_bytes, serve_in_thread
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.common.serde_utils import metadata_to_proto
from helpers import SMALL_RUN
from PIL import Image

from hydrafl import protocol
from hydrafl.client.agent import SiteAgent, default_max_download_bytes
from hydrafl.compression.layout import DOWNLOAD_RECORD
from hydrafl.data import DataError
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    SENT,
    XXH3,
    chunk_hashes,
    parse_content,
    split_message,
)

SECRET = "patient_mrn_secret"
LIMIT_BYTES = 3_000_000
echo_app = ClientApp()


@echo_app.query("echo")
def _echo(message: Message, context: Context) -> Message:
    arrays = message.content.array_records.get("arrays")
    total = (
        sum(float(array.numpy().astype(np.float64).sum()) for array in arrays.values())
        if arrays
        else 0.0
    )
    return Message(RecordDict({"metrics": MetricRecord({"sum": total})}), reply_to=message)


@echo_app.query("leak")
def _leak(message: Message, context: Context) -> Message:
    raise DataError(
        f"/srv/ward/{SECRET}.csv: there is no column 'outcome'; available columns: '{SECRET}'"
    )


@contextlib.contextmanager
def running(
    coordinator: FakeCoordinator, app: ClientApp, **options
) -> Iterator[tuple[SiteAgent, Callable[[], bool]]]:
    """The coordinator's server and a real SiteAgent serving it; yields the agent and whether it is alive."""
    server = coordinator.start()
    stop = threading.Event()
    agent = SiteAgent(coordinator.address, "site-token", app, {}, **options)
    thread, raised = serve_in_thread(agent.run, stop)
    try:
        yield agent, thread.is_alive
    finally:
        stop.set()
        thread.join(timeout=10)
        server.stop(grace=None)
    assert not raised, raised
    assert not thread.is_alive()


def _chunks(values: np.ndarray) -> tuple[pb.Envelope, list[pb.Chunk], Message]:
    message = coordinator_message("query.echo", {"w": values})
    envelope, chunks = split_message(message, server_round=1)
    return (
        envelope,
        [pb.Chunk(digest=digest, data=bytes(view)) for digest, view in chunks.items()],
        message,
    )


def _unrequested_chunk() -> tuple[pb.Envelope, list[pb.Chunk]]:
    envelope, chunks, _ = _chunks(np.arange(300_000, dtype=np.float32))  # 1.2 MB: two chunks
    extra = b"never asked for"
    return envelope, [chunks[0], pb.Chunk(digest=SENT.digest(extra), data=extra), chunks[1]]


def _repeated_chunk() -> tuple[pb.Envelope, list[pb.Chunk]]:
    envelope, chunks, _ = _chunks(np.arange(300_000, dtype=np.float32))
    return envelope, [chunks[0], chunks[0], chunks[1]]


def _oversize_chunk() -> tuple[pb.Envelope, list[pb.Chunk]]:
    """1 MiB + 4 bytes in one chunk and an empty one: the sizes add up, but a chunk holds CHUNK_BYTES."""
    envelope, _, message = _chunks(np.arange(CHUNK_BYTES // 4 + 1, dtype=np.float32))
    raw = message.content["arrays"]["w"].numpy().tobytes()
    tensor = envelope.arrays[0].tensors[0]
    tensor.chunk_digests[:] = [SENT.digest(raw), SENT.digest(b"")]
    return envelope, [
        pb.Chunk(digest=SENT.digest(raw), data=raw),
        pb.Chunk(digest=SENT.digest(b""), data=b""),
    ]


def _full_chunk_for_four_bytes() -> tuple[pb.Envelope, list[pb.Chunk]]:
    """A 4-byte tensor listing a 1 MiB chunk: many such tensors would download far more than they declare."""
    envelope, _, _ = _chunks(np.zeros(1, dtype=np.float32))
    block = bytes(CHUNK_BYTES)
    envelope.arrays[0].tensors[0].chunk_digests[:] = [SENT.digest(block)]
    return envelope, [pb.Chunk(digest=SENT.digest(block), data=block)]


def _garbage_chunk() -> tuple[pb.Envelope, list[pb.Chunk]]:
    envelope, chunks, _ = _chunks(np.arange(300_000, dtype=np.float32))
    return envelope, [
        pb.Chunk(digest=chunks[0].digest, data=b"\x00" * len(chunks[0].data)),
        chunks[1],
    ]


def _garbage_chunk_without_checksums() -> tuple[pb.Envelope, list[pb.Chunk]]:
    """A manifest from before checksums: its chunks are checked against their BLAKE3 names."""
    envelope, chunks = _garbage_chunk()
    for tensor in envelope.arrays[0].tensors:
        del tensor.chunk_checksums[:]
    return envelope, chunks


def _garbage_metadata() -> tuple[pb.Envelope, list[pb.Chunk]]:
    envelope, chunks, _ = _chunks(np.arange(10, dtype=np.float32))
    envelope.metadata = b"\xff\xfe not a Flower Metadata"
    return envelope, chunks


def _invalid_message_type() -> tuple[pb.Envelope, list[pb.Chunk]]:
    envelope, chunks, message = _chunks(np.arange(10, dtype=np.float32))
    metadata = metadata_to_proto(message.metadata)
    metadata.message_type = envelope.message_type = "bogus type"
    envelope.metadata = metadata.SerializeToString()
    return envelope, chunks


def _empty_tensors(count: int) -> pb.Envelope:
    """A manifest of `count` distinct empty tensors: no bytes declared, yet each costs the site to hold."""
    envelope = _manifest([0, 0], 0, 0)
    [record] = envelope.arrays
    template = record.tensors[0]
    for index in range(1, count):
        tensor = record.tensors.add()
        tensor.CopyFrom(template)
        tensor.name, tensor.shape[:] = f"w{index}", [0, index]
    return envelope


def _manifest(shape: list[int], nbytes: int, chunks: int, name: str = "w") -> pb.Envelope:
    """A manifest declaring `shape`, with `chunks` digests of chunks that exist nowhere."""
    envelope, _, _ = _chunks(np.zeros(1, dtype=np.float32))
    tensor = envelope.arrays[0].tensors[0]
    tensor.name, tensor.nbytes = name, nbytes
    tensor.shape[:] = shape
    tensor.chunk_digests[:] = [SENT.digest(str(i).encode()) for i in range(chunks)]
    tensor.chunk_checksums[:] = [XXH3.digest(str(i).encode()) for i in range(chunks)]
    return envelope


HOSTILE_STREAMS = {
    "a chunk it never asked for": (_unrequested_chunk, "did not ask for"),
    "a chunk sent twice": (_repeated_chunk, "did not ask for or already received"),
    "a chunk larger than a chunk can be": (
        _oversize_chunk,
        f"has {CHUNK_BYTES + 4} bytes; its manifest makes it",
    ),
    "a full chunk for a four-byte tensor": (_full_chunk_for_four_bytes, "its manifest makes it 4"),
    "a chunk failing its checksum": (_garbage_chunk, "fails its XXH3-128 checksum"),
    "a chunk failing its BLAKE3 check": (
        _garbage_chunk_without_checksums,
        "fails its BLAKE3 check",
    ),
    "garbage metadata bytes": (_garbage_metadata, "Metadata"),
    "a message type Flower refuses": (_invalid_message_type, "bogus type"),
}


@pytest.mark.parametrize("inline", [False, True], ids=["streamed", "inline"])
@pytest.mark.parametrize("case", HOSTILE_STREAMS)
def test_chunks_it_did_not_ask_for_or_cannot_trust_refuse_the_message_and_the_site_keeps_serving(
    case, inline
):
    build, reason = HOSTILE_STREAMS[case]
    envelope, stream = build()
    coordinator = FakeCoordinator()
    with running(coordinator, echo_app) as (_, alive):
        reply = coordinator.reply_to(
            coordinator.send_envelope(envelope, stream, inline=inline), alive
        )
        assert reply.error_code in (
            ErrorCode.MOD_FAILED_PRECONDITION,
            ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
        )
        assert reason in reply.error_reason and len(reply.error_reason) <= 300
        # streamed: once, exactly the chunks listed; inline: every chunk came with the message, none is fetched
        assert coordinator.chunk_requests == ([] if inline else [chunk_hashes(envelope)])
        _assert_still_serves(coordinator, alive)


HOSTILE_MANIFESTS = {
    "more than this site accepts": (
        lambda: _manifest([1024, 1024], 4 << 20, 4),
        "message declares 4.2 MB of arrays (1 tensors, counted 4096 bytes each besides their data); this site "
        "accepts at most 3.0 MB (--max-download-mb)",
    ),
    "a thousand empty tensors": (
        lambda: _empty_tensors(1000),
        "message declares 4.1 MB of arrays (1000 tensors",
    ),
    "a negative dimension": (lambda: _manifest([-1, 4], 16, 1), "shape [-1, 4]"),
    "an astronomical dimension": (
        lambda: _manifest([1 << 41, 0], 0, 0),
        "shape [2199023255552, 0]",
    ),
    "a thousand dimensions": (lambda: _manifest([1] * 1000, 4, 1), "shape"),
    "a long name and a negative dimension": (
        lambda: _manifest([-5], 0, 0, name="x" * 5000),
        "xxxx",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_MANIFESTS)
def test_a_manifest_it_cannot_or_will_not_hold_is_refused_before_any_download(case):
    build, reason = HOSTILE_MANIFESTS[case]
    envelope = build()
    coordinator = FakeCoordinator()
    with running(coordinator, echo_app, max_download_bytes=LIMIT_BYTES) as (_, alive):
        reply = coordinator.reply_to(coordinator.send_envelope(envelope), alive)
        assert reply.error_code == ErrorCode.MOD_FAILED_PRECONDITION
        assert reason in reply.error_reason and len(reply.error_reason) <= 300
        assert (
            coordinator.chunk_requests == []
        )  # refused before GetChunks: nothing fetched, nothing allocated
        _assert_still_serves(coordinator, alive)


def test_the_default_download_limit_is_half_the_machines_memory():
    assert (
        default_max_download_bytes()
        == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    )
    assert (
        SiteAgent("127.0.0.1:1", "t", echo_app, {}).max_download_bytes
        == default_max_download_bytes()
    )


def test_a_garbage_run_config_and_a_failing_app_get_error_replies_and_only_recent_runs_keep_a_context():
    coordinator = FakeCoordinator(run_configs={99: b"{not json"})
    with running(coordinator, echo_app) as (agent, alive):
        broken = coordinator_message("query.echo", {"w": np.ones(3, dtype=np.float32)}, run_id=99)
        reply = coordinator.reply_to(coordinator.send(broken), alive)
        assert reply.error_reason == "MessageRefused: the run config is not valid JSON"
        assert coordinator.chunk_requests == []
        leaking = coordinator.send(coordinator_message("query.leak"))
        reply = coordinator.reply_to(leaking, alive)
        assert reply.error_code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        assert (
            reply.error_reason
            == "DataError: this site's data does not fit this run; see the site's log"
        )
        assert SECRET.encode() not in reply.SerializeToString()
        for run_id in range(10, 16):  # a Context per run, for the most recent runs only
            coordinator.reply_to(
                coordinator.send(coordinator_message("query.echo", run_id=run_id)), alive
            )
        assert list(agent.contexts) == [12, 13, 14, 15]
        _assert_still_serves(coordinator, alive)


def test_a_demo_site_never_opens_the_file_the_run_config_names(tmp_path):
    from hydrafl.client import site_app

    export = tmp_path / f"{SECRET}_export.csv"
    rows = "".join(f"{i},{i * 0.5},{'icu' if i % 2 else 'ward'}\n" for i in range(20))
    export.write_text(f"{SECRET},lactate_secret,outcome\n{rows}")
    clean = SMALL_RUN.replace(
        sites=2, samples_per_site=40, rounds=15, local_steps=10, batch_size=32, lr=2e-3
    )
    clean = clean.to_flower()
    named_file = {"data": str(export), "label-column": "no_such_column"}
    coordinator = FakeCoordinator(
        run_configs={
            1: run_config_bytes(clean),
            2: run_config_bytes({**clean, **named_file}),
            3: run_config_bytes(
                {**clean, "task": "", "data": str(export), "label-column": "outcome"}
            ),
        }
    )
    with running(coordinator, site_app.client_app, demo=True) as (_, alive):
        demo = coordinator.reply_to(coordinator.send(coordinator_message("query.init")), alive)
        hostile = coordinator_message("query.init", config=named_file, run_id=2)
        named = coordinator.reply_to(coordinator.send(hostile), alive)
        assert not demo.error_reason and not named.error_reason
        assert _arrays(named) == _arrays(demo)  # the run task's synthetic cohort, bit for bit
        file_only = coordinator.reply_to(
            coordinator.send(coordinator_message("query.init", run_id=3)), alive
        )
        assert (
            file_only.error_reason
            == "DataError: this site's data does not fit this run; see the site's log"
        )
    for reply in coordinator.replies.values():
        wire = reply.SerializeToString()
        assert (
            SECRET.encode() not in wire
            and b"lactate" not in wire
            and str(tmp_path).encode() not in wire
        )


def test_a_chunk_over_the_site_s_message_limit_refuses_the_message_instead_of_reconnecting_for_ever():
    envelope, chunks, _ = _chunks(np.arange(300_000, dtype=np.float32))
    oversize = [
        pb.Chunk(digest=chunks[0].digest, data=bytes(9 << 20))
    ]  # over the site's 8 MiB receive limit
    coordinator = FakeCoordinator()
    with running(coordinator, echo_app) as (_, alive):
        reply = coordinator.reply_to(coordinator.send_envelope(envelope, oversize), alive)
        assert (
            reply.error_code == ErrorCode.MOD_FAILED_PRECONDITION
            and "message limit" in reply.error_reason
        )
        assert len(coordinator.chunk_requests) == 1  # asked once: no reconnect and retry
        _assert_still_serves(coordinator, alive)


class _DroppingOnce(FakeCoordinator):
    """Drops the first chunk stream after one chunk, as a lost connection does."""

    dropped = False

    def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Chunk]:
        self.chunk_requests.append(list(request.digests))
        for index, digest in enumerate(request.digests):
            if index == 1 and not self.dropped:
                self.dropped, self.in_hand = True, None
                context.abort(grpc.StatusCode.UNAVAILABLE, "connection dropped")
            yield pb.Chunk(digest=digest, data=self.blobs[digest])


def test_a_small_message_after_a_dropped_download_may_bring_the_chunks_the_site_kept():
    """The site keeps what it filled before a drop; the coordinator's next, small message brings all its chunks
    inline, one of them kept already: taken as held, not refused as a chunk the site did not ask for."""
    bias = np.arange(100, dtype=np.float32)
    first, first_chunks = split_message(
        coordinator_message("query.echo", {"bias": bias, "big": np.ones(300_000, np.float32)}), 1
    )
    second, second_chunks = split_message(coordinator_message("query.echo", {"bias": bias}), 2)
    coordinator = _DroppingOnce()
    coordinator.blobs.update({digest: bytes(data) for digest, data in first_chunks.items()})
    with running(coordinator, echo_app) as (_, alive):
        coordinator.send_envelope(first)
        inline = [
            pb.Chunk(digest=digest, data=bytes(data)) for digest, data in second_chunks.items()
        ]
        reply = coordinator.reply_to(coordinator.send_envelope(second, inline, inline=True), alive)
        assert not reply.error_reason and parse_content(reply)["metrics"]["sum"] == float(
            bias.sum()
        )
        assert coordinator.dropped
        _assert_still_serves(coordinator, alive)


def _arrays(reply: pb.Envelope) -> list[tuple[str, list[int], list[str]]]:
    return [
        (t.name, list(t.shape), list(t.chunk_digests))
        for record in reply.arrays
        for t in record.tensors
    ]


def _assert_still_serves(coordinator: FakeCoordinator, alive: Callable[[], bool]) -> None:
    """A valid message after the hostile one gets a valid reply; its manifest lists every chunk twice (the
    same tensor under two names) and the site asks for each once."""
    values = np.arange(300_000, dtype=np.float32)
    message = coordinator_message("query.echo", {"a": values, "b": values.copy()})
    asked_before = len(coordinator.chunk_requests)
    reply = coordinator.reply_to(coordinator.send(message), alive)
    assert not reply.error_reason
    assert parse_content(reply)["metrics"]["sum"] == 2 * float(values.astype(np.float64).sum())
    requests = coordinator.chunk_requests[asked_before:]
    listed = chunk_hashes(split_message(message)[0])
    assert len(listed) == 2 and requests == [listed]


HOSTILE_NEW_WIRE = {
    "secagg keys with a garbage setup": (
        protocol.QUERY_SECAGG_KEYS,
        {"round": "x" * 100_000, "sites": [1]},
        "SecAggError",
    ),
    "secagg shares out of turn": (protocol.QUERY_SECAGG_SHARES, {"keys": SECRET}, "SecAggError"),
    "secagg check out of turn": (
        protocol.QUERY_SECAGG_CHECK,
        {"survivors": [1, 2, 3]},
        "SecAggError",
    ),
    "secagg unmask out of turn": (
        protocol.QUERY_SECAGG_UNMASK,
        {"survivors": [1], "dropped": [2]},
        "SecAggError",
    ),
    "a compressed download that names no model": ("train", {"scheme": "int8"}, "download refused"),
}
"""Messages of the wire the site speaks since secure aggregation and compressed downloads, as a hostile
coordinator may write them, each with the refusal it must get: the secure-aggregation queries' record under
`secagg`, the download's under `download` (a train message)."""


@pytest.mark.parametrize("case", sorted(HOSTILE_NEW_WIRE))
def test_hostile_secure_aggregation_and_compressed_download_messages_get_error_replies_and_the_site_keeps_serving(
    case,
):
    message_type, record, refusal = HOSTILE_NEW_WIRE[case]
    message = coordinator_message(message_type, {"w": np.ones(3, dtype=np.float32)})
    message.content[DOWNLOAD_RECORD if message_type == "train" else protocol.SECAGG_RECORD] = (
        ConfigRecord(record)
    )
    coordinator = FakeCoordinator()
    with running(coordinator, echo_app) as (_, alive):
        reply = coordinator.reply_to(coordinator.send(message), alive)
        assert reply.error_reason.startswith(refusal) and len(reply.error_reason) <= 1_000, (
            reply.error_reason
        )
        assert SECRET.encode() not in reply.SerializeToString()
        _assert_still_serves(coordinator, alive)


def _image_folder(folder: Path) -> Path:
    for label in ("left", "right"):
        (folder / label).mkdir(parents=True)
        for k in range(4):
            Image.fromarray(np.full((8, 8), 40 * k, dtype=np.uint8)).save(
                folder / label / f"{k}.png"
            )
    return folder


@pytest.mark.parametrize("kind", ["image folder", "DICOM folder"])
def test_a_demo_site_never_opens_the_image_or_dicom_folder_the_run_config_names(tmp_path, kind):
    from hydrafl.client import site_app

    folder = tmp_path / f"{SECRET}_{kind.split()[0]}"
    folder = (
        _image_folder(folder) if kind == "image folder" else pattern_folder(folder, per_class=2)
    )
    clean = SMALL_RUN.replace(sites=2, samples_per_site=40).to_flower()
    named = {"data": str(folder), "label-column": "label"}
    coordinator = FakeCoordinator(
        run_configs={
            1: run_config_bytes(clean),
            2: run_config_bytes({**clean, **named}),
            3: run_config_bytes({**clean, "task": "", **named}),
        }
    )
    with running(coordinator, site_app.client_app, demo=True) as (_, alive):
        demo = coordinator.reply_to(coordinator.send(coordinator_message("query.init")), alive)
        hostile = coordinator.reply_to(
            coordinator.send(coordinator_message("query.init", config=named, run_id=2)), alive
        )
        assert not demo.error_reason and not hostile.error_reason
        assert _arrays(hostile) == _arrays(demo)  # the run task's synthetic cohort, bit for bit
        file_only = coordinator.reply_to(
            coordinator.send(coordinator_message("query.init", run_id=3)), alive
        )
        assert (
            file_only.error_reason
            == "DataError: this site's data does not fit this run; see the site's log"
        )
    for reply in coordinator.replies.values():
        assert (
            SECRET.encode() not in reply.SerializeToString()
            and str(tmp_path).encode() not in reply.SerializeToString()
        )
