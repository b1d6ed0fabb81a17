"""The wire benchmark's setup (`benchmarks/wire.py`): its scales, the update, a coordinator's database with
enrolled sites, and the calls a site makes (the hydrafl way and the raw stream)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from hydrafl.benchmarks._wire_report import GIB
from hydrafl.client.upload import Metadata
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import CHUNK_BYTES, join_message
from hydrafl.protocol import GRPC_OPTIONS, WEIGHT
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.service import CoordinatorService

ARRAYS = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    update_bytes: int
    reps: int
    component_reps: int
    sites: int
    site_bytes: int


FULL = Scale(update_bytes=GIB, reps=9, component_reps=3, sites=10, site_bytes=200_000_000)
"""Nine runs each: the raw stream alone varies 2x from run to run on this VM, so a median of five pairs still
moved the ratio by 0.1 between benchmark runs."""
QUICK = Scale(update_bytes=64 << 20, reps=3, component_reps=1, sites=4, site_bytes=20_000_000)


def make_update(total_bytes: int, seed: int) -> list[np.ndarray]:
    """ARRAYS float32 arrays, total_bytes together, values in [0, 1) (finite, so the coordinator accepts them)."""
    per_array = total_bytes // 4 // ARRAYS
    return list(
        np.random.default_rng(seed)
        .random(per_array * ARRAYS, dtype=np.float32)
        .reshape(ARRAYS, per_array)
    )


def reply_to(request: Message, arrays: list[np.ndarray]) -> Message:
    """The ClientApp's reply carrying `arrays`; building it is the app's work, so it happens before any clock."""
    record = ArrayRecord({f"w{i:02d}": Array(array) for i, array in enumerate(arrays)})
    reply = Message(
        RecordDict({"arrays": record, "metrics": MetricRecord({WEIGHT: 1})}), reply_to=request
    )
    reply.metadata.__dict__["_message_id"] = f"bench-{request.metadata.message_id}"
    return reply


UPLOAD_REQUEST = "query.upload"
"""The benchmark's requests carry no arrays (only the upload is measured); the coordinator lets a reply to such a
query carry up to its model limit, where a train reply may carry no more than the arrays it was sent."""


def send_request(grid: CoordinatorGrid, node_id: int, server_round: int) -> str:
    """The coordinator's side: address a message to the site that its update answers. A site gets one message
    per round and type, so every request is a round of its own."""
    config = ConfigRecord({"server-round": server_round})
    request = Message(
        RecordDict({"config": config}), dst_node_id=node_id, message_type=UPLOAD_REQUEST
    )
    request.metadata.group_id = str(server_round)
    [message_id] = grid.push_messages([request])
    return message_id


def pull_request(stub: CoordinatorClient, metadata: Metadata) -> Message:
    """The site's side: the request it answers (a reply must point at a message addressed to it)."""
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=metadata)
    if not pulled.has_message:
        raise RuntimeError("the site found no message to answer")
    return join_message(pulled.envelope, {})


def push_update(
    stub: CoordinatorClient,
    metadata: Metadata,
    envelope: pb.Envelope,
    chunks: Mapping[str, bytes | memoryview],
) -> dict:
    """The RPCs of a push that asks about every chunk first (a resumed one), each timed (monotonic start/end): the
    memory run names every site's chunks before the clock starts, so that only the uploads overlap."""
    times: dict[str, Any] = {"start": time.monotonic()}
    present = set(
        stub.HasChunks(pb.HasChunksRequest(digests=list(chunks)), metadata=metadata).present
    )
    missing = [digest for digest in chunks if digest not in present]
    times["put_start"] = time.monotonic()
    put = stub.PutChunks(((digest, chunks[digest]) for digest in missing), metadata=metadata)
    times["push_start"] = time.monotonic()
    pushed = stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=metadata)
    times["end"] = time.monotonic()
    return {
        "has_s": times["put_start"] - times["start"],
        "put_s": times["push_start"] - times["put_start"],
        "push_s": times["end"] - times["push_start"],
        "stored": put.stored,
        "already_present": put.already_present,
        "accepted": not pushed.duplicate,
        "times": times,
    }


def auth(token: str) -> Metadata:
    """The call metadata SiteAgent sends."""
    return (("authorization", f"Bearer {token}"),)


@dataclass(frozen=True, slots=True)
class Federation:
    """A database with enrolled sites and one running run, and the grid that addresses the sites."""

    store: Store
    grid: CoordinatorGrid
    sites: list[tuple[int, str]]
    """(node_id, token) per site"""


def new_federation(workdir: Path, sites: int) -> Federation:
    store, blobs = Store(f"sqlite:///{workdir / 'coordinator.db'}"), BlobStore(workdir / "blobs")
    enrolled = [store.add_site(f"site-{i}") for i in range(sites)]
    run = store.create_run({"rounds": 1})
    store.set_run_status(run.id, "running")
    grid = CoordinatorGrid(store, blobs, CoordinatorService(store, blobs), run.id)
    return Federation(store, grid, [(site.node_id, token) for site, token in enrolled])


def coordinator_args(workdir: Path) -> tuple[str, ...]:
    """The coordinator child shares the database and blob folder of `new_federation(workdir, ...)`."""
    return (
        "--db",
        f"sqlite:///{workdir / 'coordinator.db'}",
        "--blobs",
        str(workdir / "blobs"),
        "--runs",
        str(workdir / "runs"),
    )


def channel(address: str) -> grpc.Channel:
    """One connection per channel, as separate sites have (channels in one process share one by default)."""
    return grpc.insecure_channel(
        address, options=[*GRPC_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    )


def raw_push(put: Callable[..., bytes], arrays: list[np.ndarray]) -> dict:
    """The same bytes as 1 MiB messages on one client stream: the floor any chunked upload over gRPC pays."""

    def stream() -> Iterator[bytes]:
        for array in arrays:
            view = array.data.cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                yield bytes(view[start : start + CHUNK_BYTES])

    gc.collect()
    started = time.perf_counter()
    received = int.from_bytes(put(stream()), "little")
    return {"seconds": time.perf_counter() - started, "received": received}
