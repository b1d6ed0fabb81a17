"""hydrafl's upload path vs a raw gRPC stream over loopback, and the coordinator's memory under concurrent pushes.

    python -m hydrafl.benchmarks.wire [--out DIR] [--quick]

Upload: one update (16 float32 arrays, 1 GiB in all) goes up the hydrafl way, with the site's own code
(`client.upload.upload_reply`): HasChunks of the first chunk's XXH3-128 name (not there: a first push) ->
PutChunks (a stream of 1 MiB chunks, each named as it is sent; the coordinator's writer threads check each one's
XXH3 and write it into the stream's pack file past the page cache (`server.packs`) while the next ones arrive,
noting which chunks hold only finite float32) -> PushReply (the coordinator checks the manifest and chunk sizes,
reads back only chunks not known finite, makes every chunk durable with one syncfs, and records the reply in
SQLite). The baseline streams the same bytes in 1 MiB messages to a stream-unary handler that only counts them,
served with the coordinator's thread pool and gRPC options. Both servers are separate processes (as a site and its
coordinator are); both clients start from the same numpy arrays. Building the reply Message is the ClientApp's job
and is not timed. The two alternate order over the repetitions; every repetition marks each chunk differently, so
nothing is deduplicated. Each accepted update is read back through `CoordinatorGrid.pull_messages` and compared
byte for byte. Components (hashing, blob writes with and without fsync, PushReply's work, its SQLite writes) are
timed alone on the same bytes, in this process, to say where hydrafl's time goes; "durable write floor" is the
time the writer pool needs to write the bytes and sync them once with no other work: no durable upload to this
disk can beat it, so raw / floor is the highest ratio reachable here. "Raw beside the floor" runs the raw stream
while the coordinator's process writes the floor's bytes, both at once: on this VM the two slow each other
down, so raw / (both at once) says what receiving and storing an update costs with no hydrafl code at all.

Download: the same size of model from the coordinator to a site (`_wire_download`), against a raw server stream.
The throughput runs again with the coordinator's database and blobs on tmpfs (/dev/shm, where fsync is free but
O_DIRECT is refused, so packs are written through the page cache: every page of it memory new to the process).

Memory: a fresh coordinator process; `--sites` sites push one update each at the same moment (threads here,
one connection each, chunks split beforehand so that the uploads really overlap). Its RSS is sampled every
50 ms; "extra" is the peak over its RSS when idle (after every site joined and pulled its request), in
multiples of one update. The kernel's high-water mark (VmHWM) is read too, and the RSS 1 s after the pushes
(what the process kept).

Goals: throughput ratio hydrafl/raw >= 0.7, up and down; coordinator peak extra RSS < 3 updates.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks._wire_download import download_throughput
from hydrafl.benchmarks._wire_floor import durable_writes, raw_beside_floor
from hydrafl.benchmarks._wire_pairs import mark, paired_runs, rates
from hydrafl.benchmarks._wire_report import GIB, GOAL_EXTRA_UPDATES, GOAL_RATIO, plot, print_tables
from hydrafl.benchmarks._wire_server import RAW_METHOD, RssSampler, ServerProcess, filesystem
from hydrafl.client.upload import Metadata, upload_reply
from hydrafl.identity import claim_server_identity
from hydrafl.malloc_tuning import keep_freed_memory
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    INLINE_BYTES,
    SENT,
    UPLOADED,
    join_message,
    split_message,
)
from hydrafl.protocol import GRPC_OPTIONS, WEIGHT
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.limits import SiteLimits
from hydrafl.server.transport.packs import UploadPacks
from hydrafl.server.transport.replies import check_reply
from hydrafl.server.transport.service import CoordinatorService

NAME = "wire"
ARRAYS = 16
MB = 1e6  # decimal megabytes, as in "200 MB per site"
PHASES = ("ask_s", "put_s", "push_s")
MEMORY_ROUND, THROUGHPUT_ROUND = (
    1,
    2,
)  # the rounds the requests belong to (the throughput reps take 2, 3, ...)


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


# ---- the update and the site side ---------------------------------------------------------------------


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
    stub: CoordinatorClient, metadata: Metadata, envelope: pb.Envelope, chunks: dict[str, bytes]
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


# ---- throughput -----------------------------------------------------------------------------------------


def hydrafl_push(
    stub: CoordinatorClient,
    token: str,
    grid: CoordinatorGrid,
    node_id: int,
    server_round: int,
    arrays: list[np.ndarray],
) -> dict:
    """One timed site-side upload (`SiteAgent._push`'s `upload_reply`), then, untimed, the stored reply read back
    as the grid reads it."""
    message_id = send_request(grid, node_id, server_round)
    reply = reply_to(pull_request(stub, auth(token)), arrays)
    gc.collect()
    started = time.perf_counter()
    uploaded = upload_reply(stub, auth(token), reply, server_round, inline_bytes=INLINE_BYTES)
    seconds = time.perf_counter() - started
    del reply
    [stored] = grid.pull_messages([message_id])
    record = stored.content["arrays"]
    exact = [np.array_equal(record[f"w{i:02d}"].numpy(), array) for i, array in enumerate(arrays)]
    return {
        "seconds": seconds,
        **{f"{phase}_s": value for phase, value in uploaded.seconds.items()},
        "stored": uploaded.stored,
        "already_present": uploaded.already_present,
        "accepted": not uploaded.duplicate,
        "byte_exact": all(exact) and len(record) == len(arrays),
    }


def raw_push(put: Callable[..., bytes], arrays: list[np.ndarray]) -> dict:
    """The same bytes as 1 MiB messages on one client stream: the floor any chunked upload over gRPC pays."""

    def stream() -> Iterator[bytes]:
        for array in arrays:
            view = memoryview(array).cast("B")
            for start in range(0, len(view), CHUNK_BYTES):
                yield bytes(view[start : start + CHUNK_BYTES])

    gc.collect()
    started = time.perf_counter()
    received = int.from_bytes(put(stream()), "little")
    return {"seconds": time.perf_counter() - started, "received": received}


def throughput(
    scale: Scale, federation: Federation, coordinator: ServerProcess, raw: ServerProcess
) -> dict[str, Any]:
    """Median site-side seconds of the hydrafl push and of the raw stream, same bytes, alternating order."""
    grid, (node_id, token) = federation.grid, federation.sites[0]
    arrays = make_update(scale.update_bytes, seed=0)
    with channel(coordinator.address) as hydrafl_channel, channel(raw.address) as raw_channel:
        stub, put = CoordinatorClient(hydrafl_channel), raw_channel.stream_unary(RAW_METHOD)
        runs = paired_runs(
            scale.reps,
            arrays,
            lambda rep: hydrafl_push(stub, token, grid, node_id, THROUGHPUT_ROUND + rep, arrays),
            lambda: raw_push(put, arrays),
        )
    median, gib_per_s, ratio = rates(runs, scale.update_bytes)
    phases = {key: statistics.median(run[key] for run in runs["hydrafl"]) for key in PHASES}
    chunks = scale.update_bytes // CHUNK_BYTES
    checks = {
        "accepted": all(run["accepted"] for run in runs["hydrafl"]),
        "all_chunks_stored": all(
            run["stored"] == chunks and run["already_present"] == 0 for run in runs["hydrafl"]
        ),
        "byte_exact": all(run["byte_exact"] for run in runs["hydrafl"]),
        "raw_bytes_received": all(run["received"] == scale.update_bytes for run in runs["raw"]),
    }
    return {
        "update_bytes": scale.update_bytes,
        "arrays": ARRAYS,
        "chunks": chunks,
        "reps": scale.reps,
        "runs": runs,
        "median_s": median,
        "gib_per_s": gib_per_s,
        "hydrafl_phases_median_s": phases,
        "put_only_gib_per_s": scale.update_bytes / phases["put_s"] / GIB,
        "ratio_hydrafl_over_raw": ratio,
        "goal": GOAL_RATIO,
        "goal_met": ratio >= GOAL_RATIO,
        "checks": {**checks, "passed": all(checks.values())},
    }


def components(scale: Scale, workdir: Path) -> dict[str, Any]:
    """The pieces of hydrafl's path, timed alone on one update's chunks (median of `component_reps`)."""
    arrays = make_update(scale.update_bytes, seed=2)
    claim_server_identity(1)
    request = Message(RecordDict(), dst_node_id=1, message_type=UPLOAD_REQUEST)
    request.metadata.__dict__["_message_id"] = "components"  # a reply names its chunks as an upload
    envelope, chunks = split_message(reply_to(request, arrays), 1)
    del arrays
    seconds: dict[str, list[float]] = {}

    def timed(name: str, work: Callable[[], object]) -> None:
        gc.collect()
        started = time.perf_counter()
        work()
        seconds.setdefault(name, []).append(time.perf_counter() - started)

    def put_all(folder: Path) -> UploadPacks:
        shutil.rmtree(folder, ignore_errors=True)
        uploads = BlobStore(folder).uploads(site.node_id)
        uploads.put_stream(chunks.items())
        return uploads

    sent, _ = split_message(request, 1)

    def push_reply_work(
        blobs: UploadPacks,
    ) -> None:  # CoordinatorService.PushReply between its two SQLite calls
        check_reply(
            envelope,
            sent,
            chunk_size=blobs.size,
            chunk_bytes=blobs.get,
            weighted_by_key=WEIGHT,
            max_model_bytes=SiteLimits().max_model_bytes,
            known_finite=blobs.finite_float32,
        )
        blobs.sync()

    store = Store(f"sqlite:///{workdir / 'components.db'}")
    site, token = store.add_site("site")
    run = store.create_run({})
    store.set_run_status(run.id, "running")
    serialized = envelope.SerializeToString()

    def sqlite_calls(
        message_id: str,
    ) -> None:  # what one upload (HasChunks, PutChunks, PushReply) asks of the store
        for _ in range(3):
            store.authenticate(token)
        outbound = store.outbound(message_id)
        store.run(outbound.run_id)
        store.add_reply(outbound, serialized)
        store.audit("update-accepted", site_name=site.name, run_id=run.id, detail=message_id)

    for rep in range(scale.component_reps):
        timed("upload_digest_s", lambda: UPLOADED.digests(list(chunks.values())))
        timed("content_digest_s", lambda: SENT.digests(list(chunks.values())))
        shutil.rmtree(workdir / "floor", ignore_errors=True)
        timed("durable_floor_s", lambda: durable_writes(chunks, workdir / "floor"))
        timed("blob_put_no_sync_s", lambda: put_all(workdir / "blobs-no-sync"))
        timed("blob_put_s", lambda: put_all(workdir / "blobs-sync").sync())
        synced = put_all(workdir / "blobs-sync")
        timed("push_reply_work_s", lambda: push_reply_work(synced))
        store.add_outbound(f"m{rep}", run.id, 1, site.node_id, b"")
        timed("sqlite_per_push_s", lambda: sqlite_calls(f"m{rep}"))
    tracemalloc.start()  # what one PushReply holds at once (numpy and bytes allocations are both traced)
    push_reply_work(synced)
    push_reply_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    shutil.rmtree(workdir / "blobs-no-sync")
    shutil.rmtree(workdir / "blobs-sync")
    shutil.rmtree(workdir / "floor")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    median["sync_s"] = median["blob_put_s"] - median["blob_put_no_sync_s"]
    return {
        "update_bytes": scale.update_bytes,
        "runs": seconds,
        "median_s": median,
        "push_reply_peak_updates": push_reply_peak / scale.update_bytes,
        "filesystem": filesystem(workdir),
    }


def concurrent_memory(
    scale: Scale, federation: Federation, coordinator: ServerProcess
) -> dict[str, Any]:
    """Peak extra RSS of a fresh coordinator process while every site pushes one update at the same moment."""
    store, grid, sites = federation.store, federation.grid, federation.sites
    message_ids = [send_request(grid, node_id, MEMORY_ROUND) for node_id, _ in sites]
    sampler = RssSampler(coordinator.pid).start()
    channels = [channel(coordinator.address) for _ in sites]
    try:
        stubs = [CoordinatorClient(site_channel) for site_channel in channels]
        requests = [
            pull_request(stub, auth(token)) for stub, (_, token) in zip(stubs, sites, strict=True)
        ]
        arrays = make_update(scale.site_bytes, seed=1)
        prepared = []
        for i, request in enumerate(
            requests
        ):  # the sites' split_message, before the clock: only uploads overlap
            mark(arrays, -(i + 1.0))
            prepared.append(split_message(reply_to(request, arrays), MEMORY_ROUND))
        del arrays
        gc.collect()
        time.sleep(0.5)
        settle = time.monotonic()
        time.sleep(0.5)
        idle = statistics.median(rss for at, rss in sampler.samples if at >= settle)
        idle_hwm = sampler.high_water_mark()
        barrier = threading.Barrier(len(sites))
        results: list[dict | BaseException] = [{}] * len(sites)

        def push(i: int) -> None:
            envelope, chunks = prepared[i]
            barrier.wait()
            try:
                results[i] = push_update(stubs[i], auth(sites[i][1]), envelope, chunks)
            except grpc.RpcError as error:
                results[i] = error

        started = time.monotonic()
        threads = [threading.Thread(target=push, args=(i,)) for i in range(len(sites))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        finished = time.monotonic()
        time.sleep(1.0)
        peak, hwm, after = sampler.peak(since=started), sampler.high_water_mark(), sampler.now()
    finally:
        sampler.stop()
        for site_channel in channels:
            site_channel.close()
    failures = [f"{r.code().name}: {r.details()}" for r in results if isinstance(r, grpc.RpcError)]
    pushes = [r for r in results if isinstance(r, dict)]
    update = scale.site_bytes
    extra = peak - idle
    accepted_in_store = len(store.replies_to(message_ids))
    checks = {
        "no_rpc_errors": not failures,
        "all_accepted": all(p["accepted"] for p in pushes) and accepted_in_store == len(sites),
        "sampled_during_pushes": sum(started <= at <= finished for at, _ in sampler.samples) >= 3,
    }
    return {
        "sites": len(sites),
        "update_mb": update / MB,
        "idle_mb": idle / MB,
        "peak_mb": peak / MB,
        "peak_extra_mb": extra / MB,
        "peak_extra_updates": extra / update,
        "vmhwm_idle_mb": idle_hwm / MB,
        "vmhwm_mb": hwm / MB,
        "vmhwm_extra_updates": (hwm - idle) / update,
        "after_mb": after / MB,
        "retained_updates": (after - idle) / update,
        "wall_s": finished - started,
        "max_concurrent": {
            "PutChunks": max_overlap(
                [(p["times"]["put_start"], p["times"]["push_start"]) for p in pushes]
            ),
            "PushReply": max_overlap(
                [(p["times"]["push_start"], p["times"]["end"]) for p in pushes]
            ),
        },
        "pushes": [
            {key: p[key] for key in ("has_s", "put_s", "push_s", "stored", "accepted")}
            for p in pushes
        ],
        "failures": failures,
        "accepted_in_store": accepted_in_store,
        "rss_trace": [
            (round(at - started, 3), round(rss / MB, 1))
            for at, rss in sampler.samples
            if at >= settle
        ],
        "push_windows": [
            (p["times"]["push_start"] - started, p["times"]["end"] - started) for p in pushes
        ],
        "goal_extra_updates": GOAL_EXTRA_UPDATES,
        "goal_met": extra / update < GOAL_EXTRA_UPDATES,
        "checks": {**checks, "passed": all(checks.values())},
    }


def max_overlap(windows: list[tuple[float, float]]) -> int:
    """The most windows open at one instant."""
    events = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows])
    open_now = most = 0
    for _, step in events:
        open_now += step
        most = max(most, open_now)
    return most


# ---- report ---------------------------------------------------------------------------------------------


def throughput_on_tmpfs(scale: Scale, raw: ServerProcess) -> dict[str, Any] | None:
    """The throughput run against a coordinator whose database and blobs live in /dev/shm (None without it).
    Reported beside the goal, which is for a disk-backed store, so it carries no goal of its own."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    with tempfile.TemporaryDirectory(prefix="hydrafl-wire-", dir=shm) as tmp:
        work = Path(tmp)
        with ServerProcess(
            "coordinator", *coordinator_args(work), log_path=work / "coordinator.log"
        ) as coordinator:
            coordinator.wait_ready()
            result = throughput(scale, new_federation(work, 1), coordinator, raw)
    del result["goal"], result["goal_met"]
    return result


def main() -> None:
    keep_freed_memory()  # this process is the site of every run here, and takes its memory setting (`hydrafl site`)
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-wire-") as tmp:
        work = Path(tmp)
        (work / "components").mkdir()
        # both import in parallel; the coordinator serves the memory run first, while it is fresh
        with (
            ServerProcess(
                "coordinator", *coordinator_args(work), log_path=work / "coordinator.log"
            ) as coordinator,
            ServerProcess("raw", log_path=work / "raw.log") as raw,
        ):
            coordinator.wait_ready()
            raw.wait_ready()
            federation = new_federation(work, scale.sites)
            memory = concurrent_memory(scale, federation, coordinator)
            summary: dict[str, Any] = {
                "benchmark": NAME,
                "quick": args.quick,
                "config": {
                    "update_bytes": scale.update_bytes,
                    "arrays": ARRAYS,
                    "chunk_bytes": CHUNK_BYTES,
                    "reps": scale.reps,
                    "component_reps": scale.component_reps,
                    "sites": scale.sites,
                    "site_bytes": scale.site_bytes,
                    "cpus": psutil.cpu_count(),
                },
                "throughput": throughput(scale, federation, coordinator, raw),
                "memory": memory,
                "download": download_throughput(scale, federation, coordinator, raw),
                "raw_beside_floor": raw_beside_floor(scale, coordinator, raw, work),
            }
            summary["throughput_tmpfs"] = throughput_on_tmpfs(scale, raw)
        summary["components"] = components(scale, work / "components")
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
