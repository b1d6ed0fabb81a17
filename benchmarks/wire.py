"""hydrafl's upload path vs a raw gRPC stream over loopback, and the coordinator's memory under concurrent pushes.

    python -m hydrafl.benchmarks.wire [--out DIR] [--quick]

Throughput: one update (16 float32 arrays, 1 GiB in all) goes up the hydrafl way, as a site does it:
split_message (views of the arrays' bytes, every 1 MiB chunk hashed on a thread pool) -> HasChunks ->
PutChunks (a stream of 1 MiB chunks; the coordinator's writer threads re-hash each one and write + fsync it
as a blob while the next ones arrive) -> PushReply (the coordinator re-reads every chunk, checks it is
finite, and records the reply in SQLite). The baseline streams the same
bytes in 1 MiB messages to a stream-unary handler that only counts them, served with the coordinator's thread
pool and gRPC options. Both servers are separate processes (as a site and its coordinator are); both clients
start from the same numpy arrays. Building the reply Message is the ClientApp's job and is not timed. The two
alternate order over the repetitions; every repetition marks each chunk differently, so nothing is
deduplicated. Each accepted update is read back through `CoordinatorGrid.pull_messages` and compared byte for
byte. Components (hashing, blob writes with and without fsync, PushReply's work, its SQLite writes) are timed
alone on the same bytes, in this process, to say where hydrafl's time goes; "durable write floor" is the
time the writer pool needs to write and fsync the bytes with no other work: no durable upload to this disk
can beat it, so raw / floor is the highest ratio reachable here. The throughput runs again with the
coordinator's database and blobs on tmpfs (/dev/shm, where fsync is free), which measures the protocol
without the disk.

Memory: a fresh coordinator process; `--sites` sites push one update each at the same moment (threads here,
one connection each, chunks split beforehand so that the uploads really overlap). Its RSS is sampled every
50 ms; "extra" is the peak over its RSS when idle (after every site joined and pulled its request), in
multiples of one update. The kernel's high-water mark (VmHWM) is read too, and the RSS 1 s after the pushes
(what the process kept).

Goals (from the issue): throughput ratio hydrafl/raw >= 0.7; coordinator peak extra RSS < 3 updates.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import matplotlib

matplotlib.use("Agg")
import grpc  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import psutil  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser, verdict  # noqa: E402
from hydrafl.benchmarks._wire_server import RAW_METHOD, RssSampler, ServerProcess  # noqa: E402
from hydrafl.client.agent import CHANNEL_OPTIONS  # noqa: E402
from hydrafl.identity import claim_server_identity  # noqa: E402
from hydrafl.proto import coordinator_pb2 as pb  # noqa: E402
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub  # noqa: E402
from hydrafl.proto.envelope import CHUNK_BYTES, join_message, sha256, sha256_all, split_message  # noqa: E402
from hydrafl.server.blobs import WRITERS  # noqa: E402
from hydrafl.server.blobs import BlobStore  # noqa: E402
from hydrafl.server.grid import CoordinatorGrid  # noqa: E402
from hydrafl.server.limits import SiteLimits  # noqa: E402
from hydrafl.server.replies import check_reply  # noqa: E402
from hydrafl.server.service import WEIGHT_KEY, CoordinatorService  # noqa: E402
from hydrafl.server.store import Store  # noqa: E402

NAME = "wire"
ARRAYS = 16
GOAL_RATIO = 0.7
GOAL_EXTRA_UPDATES = 3.0
GIB = 1 << 30
MB = 1e6  # decimal megabytes, as in "200 MB per site"
PHASES = ("split_s", "has_s", "put_s", "push_s")
MEMORY_ROUND, THROUGHPUT_ROUND = 1, 2  # the rounds the requests belong to (the throughput reps take 2, 3, ...)
Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    update_bytes: int
    reps: int
    component_reps: int
    sites: int
    site_bytes: int


FULL = Scale(update_bytes=GIB, reps=3, component_reps=3, sites=10, site_bytes=200_000_000)
QUICK = Scale(update_bytes=64 << 20, reps=3, component_reps=1, sites=4, site_bytes=20_000_000)


# ---- the update and the site side ---------------------------------------------------------------------


def make_update(total_bytes: int, seed: int) -> list[np.ndarray]:
    """ARRAYS float32 arrays, total_bytes together, values in [0, 1) (finite, so the coordinator accepts them)."""
    per_array = total_bytes // 4 // ARRAYS
    return list(np.random.default_rng(seed).random(per_array * ARRAYS, dtype=np.float32).reshape(ARRAYS, per_array))


def mark(arrays: list[np.ndarray], value: float) -> None:
    """Write `value` (negative: never a data value) at the start of every chunk, so no chunk is already stored."""
    for array in arrays:
        array[:: CHUNK_BYTES // 4] = value


def reply_to(request: Message, arrays: list[np.ndarray]) -> Message:
    """The ClientApp's reply carrying `arrays`; building it is the app's work, so it happens before any clock."""
    record = ArrayRecord({f"w{i:02d}": Array(array) for i, array in enumerate(arrays)})
    reply = Message(RecordDict({"arrays": record, "metrics": MetricRecord({"num-examples": 1})}), reply_to=request)
    reply.metadata.__dict__["_message_id"] = f"bench-{request.metadata.message_id}"
    return reply


UPLOAD_REQUEST = "query.upload"
"""The benchmark's requests carry no arrays (only the upload is measured); the coordinator lets a reply to such a
query carry up to its model limit, where a train reply may carry no more than the arrays it was sent."""


def send_request(grid: CoordinatorGrid, node_id: int, server_round: int) -> str:
    """The coordinator's side: address a message to the site that its update answers. A site gets one message
    per round and type, so every request is a round of its own."""
    config = ConfigRecord({"server-round": server_round})
    request = Message(RecordDict({"config": config}), dst_node_id=node_id, message_type=UPLOAD_REQUEST)
    request.metadata.group_id = str(server_round)
    [message_id] = grid.push_messages([request])
    return message_id


def pull_request(stub: CoordinatorStub, metadata: Metadata) -> Message:
    """The site's side: the request it answers (a reply must point at a message addressed to it)."""
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=metadata)
    if not pulled.has_message:
        raise RuntimeError("the site found no message to answer")
    return join_message(pulled.envelope, {})


def push_update(stub: CoordinatorStub, metadata: Metadata, envelope: pb.Envelope, chunks: dict[str, bytes]) -> dict:
    """The RPCs of `SiteAgent._push` after its split_message, each timed (monotonic start/end)."""
    times: dict[str, Any] = {"start": time.monotonic()}
    present = set(stub.HasChunks(pb.HasChunksRequest(sha256=list(chunks)), metadata=metadata).present)
    missing = [digest for digest in chunks if digest not in present]
    times["put_start"] = time.monotonic()
    put = stub.PutChunks((pb.Chunk(sha256=digest, data=bytes(chunks[digest])) for digest in missing), metadata=metadata)
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
    return ("--db", f"sqlite:///{workdir / 'coordinator.db'}", "--blobs", str(workdir / "blobs"),
            "--runs", str(workdir / "runs"))


def channel(address: str) -> grpc.Channel:
    """One connection per channel, as separate sites have (channels in one process share one by default)."""
    return grpc.insecure_channel(address, options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)])


# ---- throughput -----------------------------------------------------------------------------------------


def hydrafl_push(
    stub: CoordinatorStub, token: str, grid: CoordinatorGrid, node_id: int, server_round: int, arrays: list[np.ndarray]
) -> dict:
    """One timed site-side upload (split + RPCs), then, untimed, the stored reply read back as the grid reads it."""
    message_id = send_request(grid, node_id, server_round)
    reply = reply_to(pull_request(stub, auth(token)), arrays)
    gc.collect()
    started = time.perf_counter()
    envelope, chunks = split_message(reply, server_round)
    split_s = time.perf_counter() - started
    result = push_update(stub, auth(token), envelope, chunks)
    seconds = time.perf_counter() - started
    del reply, chunks
    [stored] = grid.pull_messages([message_id])
    record = stored.content["arrays"]
    exact = [np.array_equal(record[f"w{i:02d}"].numpy(), array) for i, array in enumerate(arrays)]
    del result["times"]
    return {"seconds": seconds, "split_s": split_s, **result, "byte_exact": all(exact) and len(record) == len(arrays)}


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


def throughput(scale: Scale, federation: Federation, coordinator: ServerProcess, raw: ServerProcess) -> dict[str, Any]:
    """Median site-side seconds of the hydrafl push and of the raw stream, same bytes, alternating order."""
    grid, (node_id, token) = federation.grid, federation.sites[0]
    arrays = make_update(scale.update_bytes, seed=0)
    runs: dict[str, list[dict]] = {"hydrafl": [], "raw": []}
    with channel(coordinator.address) as hydrafl_channel, channel(raw.address) as raw_channel:
        stub, put = CoordinatorStub(hydrafl_channel), raw_channel.stream_unary(RAW_METHOD)
        for rep in range(scale.reps):
            mark(arrays, -(rep + 1.0))
            for name in ("hydrafl", "raw") if rep % 2 == 0 else ("raw", "hydrafl"):
                if name == "hydrafl":
                    runs[name].append(hydrafl_push(stub, token, grid, node_id, THROUGHPUT_ROUND + rep, arrays))
                else:
                    runs[name].append(raw_push(put, arrays))
    median = {name: statistics.median(run["seconds"] for run in done) for name, done in runs.items()}
    gib_per_s = {name: scale.update_bytes / seconds / GIB for name, seconds in median.items()}
    ratio = gib_per_s["hydrafl"] / gib_per_s["raw"]
    phases = {key: statistics.median(run[key] for run in runs["hydrafl"]) for key in PHASES}
    chunks = scale.update_bytes // CHUNK_BYTES
    checks = {
        "accepted": all(run["accepted"] for run in runs["hydrafl"]),
        "all_chunks_stored": all(run["stored"] == chunks and run["already_present"] == 0 for run in runs["hydrafl"]),
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


def durable_writes(chunks: dict[str, memoryview], folder: Path) -> None:
    """Write and fsync every chunk on the blob store's pool size of threads, nothing else: the disk's part."""
    folder.mkdir()

    def write(item: tuple[int, memoryview]) -> None:
        descriptor = os.open(folder / str(item[0]), os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.write(descriptor, item[1])
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    with ThreadPoolExecutor(WRITERS) as pool:
        list(pool.map(write, enumerate(chunks.values())))


def components(scale: Scale, workdir: Path) -> dict[str, Any]:
    """The pieces of hydrafl's path, timed alone on one update's chunks (median of `component_reps`)."""
    arrays = make_update(scale.update_bytes, seed=2)
    claim_server_identity(1)
    request = Message(RecordDict(), dst_node_id=1, message_type=UPLOAD_REQUEST)
    envelope, chunks = split_message(reply_to(request, arrays), 1)
    del arrays
    seconds: dict[str, list[float]] = {}

    def timed(name: str, work: Callable[[], object]) -> None:
        gc.collect()
        started = time.perf_counter()
        work()
        seconds.setdefault(name, []).append(time.perf_counter() - started)

    def put_all(folder: Path) -> BlobStore:
        shutil.rmtree(folder, ignore_errors=True)
        blobs = BlobStore(folder)
        blobs.put_stream(chunks.items())
        return blobs

    sent, _ = split_message(request, 1)

    def push_reply_work(blobs: BlobStore) -> None:  # CoordinatorService.PushReply between its two SQLite calls
        check_reply(envelope, sent, chunk_size=blobs.size, chunk_bytes=blobs.get, weighted_by_key=WEIGHT_KEY,
                    max_model_bytes=SiteLimits().max_model_bytes)

    store = Store(f"sqlite:///{workdir / 'components.db'}")
    site, token = store.add_site("site")
    run = store.create_run({})
    store.set_run_status(run.id, "running")
    serialized = envelope.SerializeToString()

    def sqlite_calls(message_id: str) -> None:  # what one upload (HasChunks, PutChunks, PushReply) asks of the store
        for _ in range(3):
            store.authenticate(token)
        outbound = store.outbound(message_id)
        store.run(outbound.run_id)
        store.add_reply(outbound, serialized)
        store.audit("update-accepted", site_name=site.name, run_id=run.id, detail=message_id)

    for rep in range(scale.component_reps):
        timed("sha256_s", lambda: [sha256(data) for data in chunks.values()])
        timed("sha256_pool_s", lambda: sha256_all(list(chunks.values())))
        shutil.rmtree(workdir / "floor", ignore_errors=True)
        timed("durable_floor_s", lambda: durable_writes(chunks, workdir / "floor"))
        with mock.patch("os.fsync"):
            timed("blob_put_no_fsync_s", lambda: put_all(workdir / "blobs-no-fsync"))
        timed("blob_put_s", lambda: put_all(workdir / "blobs-fsync"))
        timed("push_reply_work_s", lambda: push_reply_work(BlobStore(workdir / "blobs-fsync")))
        store.add_outbound(f"m{rep}", run.id, 1, site.node_id, b"")
        timed("sqlite_per_push_s", lambda: sqlite_calls(f"m{rep}"))
    tracemalloc.start()  # what one PushReply holds at once (numpy and bytes allocations are both traced)
    push_reply_work(BlobStore(workdir / "blobs-fsync"))
    push_reply_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    shutil.rmtree(workdir / "blobs-no-fsync")
    shutil.rmtree(workdir / "blobs-fsync")
    shutil.rmtree(workdir / "floor")
    median = {name: statistics.median(values) for name, values in seconds.items()}
    median["fsync_s"] = median["blob_put_s"] - median["blob_put_no_fsync_s"]
    return {
        "update_bytes": scale.update_bytes,
        "runs": seconds,
        "median_s": median,
        "push_reply_peak_updates": push_reply_peak / scale.update_bytes,
        "filesystem": filesystem(workdir),
    }


def filesystem(path: Path) -> str:
    """The filesystem holding the blobs (fsync costs depend on it)."""
    mounts = [part for part in psutil.disk_partitions(all=True) if str(path.resolve()).startswith(part.mountpoint)]
    best = max(mounts, key=lambda part: len(part.mountpoint))
    return f"{best.fstype} on {best.device} ({best.mountpoint})"


# ---- memory ---------------------------------------------------------------------------------------------


def concurrent_memory(scale: Scale, federation: Federation, coordinator: ServerProcess) -> dict[str, Any]:
    """Peak extra RSS of a fresh coordinator process while every site pushes one update at the same moment."""
    store, grid, sites = federation.store, federation.grid, federation.sites
    message_ids = [send_request(grid, node_id, MEMORY_ROUND) for node_id, _ in sites]
    sampler = RssSampler(coordinator.pid).start()
    channels = [channel(coordinator.address) for _ in sites]
    try:
        stubs = [CoordinatorStub(site_channel) for site_channel in channels]
        requests = [pull_request(stub, auth(token)) for stub, (_, token) in zip(stubs, sites, strict=True)]
        arrays = make_update(scale.site_bytes, seed=1)
        prepared = []
        for i, request in enumerate(requests):  # the sites' split_message, before the clock: only uploads overlap
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
            "PutChunks": max_overlap([(p["times"]["put_start"], p["times"]["push_start"]) for p in pushes]),
            "PushReply": max_overlap([(p["times"]["push_start"], p["times"]["end"]) for p in pushes]),
        },
        "pushes": [
            {key: p[key] for key in ("has_s", "put_s", "push_s", "stored", "accepted")} for p in pushes
        ],
        "failures": failures,
        "accepted_in_store": accepted_in_store,
        "rss_trace": [(round(at - started, 3), round(rss / MB, 1)) for at, rss in sampler.samples if at >= settle],
        "push_windows": [(p["times"]["push_start"] - started, p["times"]["end"] - started) for p in pushes],
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


def print_tables(summary: dict[str, Any]) -> None:
    tput, parts, mem = summary["throughput"], summary["components"], summary["memory"]
    console = Console()
    size = tput["update_bytes"] / GIB
    table = Table(title=f"one {size:g} GiB update over loopback ({tput['chunks']} chunks), median of {tput['reps']}")
    for column in ("path", "median s", "GiB/s", "runs s"):
        table.add_column(column, justify="right")
    for name in ("hydrafl", "raw"):
        runs = " ".join(f"{run['seconds']:.2f}" for run in tput["runs"][name])
        table.add_row(name, f"{tput['median_s'][name]:.2f}", f"{tput['gib_per_s'][name]:.3f}", runs)
    console.print(table)
    checks = tput["checks"]
    console.print(
        f"hydrafl/raw throughput {tput['ratio_hydrafl_over_raw']:.2f}: {verdict(tput['goal_met'])} (goal >= "
        f"{GOAL_RATIO:g}); accepted and byte-exact: {verdict(checks['passed'], 'PASS', 'FAIL')}"
    )
    if summary.get("throughput_tmpfs"):
        shm = summary["throughput_tmpfs"]
        console.print(
            f"with the coordinator's database and blobs on tmpfs: hydrafl {shm['gib_per_s']['hydrafl']:.3f} GiB/s, "
            f"raw {shm['gib_per_s']['raw']:.3f} GiB/s, ratio {shm['ratio_hydrafl_over_raw']:.2f} "
            f"({verdict(shm['goal_met'])}); accepted and byte-exact: {verdict(shm['checks']['passed'], 'PASS', 'FAIL')}"
        )
    table = Table(title=f"where hydrafl's time goes ({size:g} GiB; phases median, components timed alone)")
    table.add_column("step")
    table.add_column("seconds", justify="right")
    table.add_column("what", justify="left")
    phases, median = tput["hydrafl_phases_median_s"], parts["median_s"]
    rows = [
        ("split_message", phases["split_s"], "site: views of the bytes, SHA-256 of each chunk on a pool"),
        ("HasChunks", phases["has_s"], "one call with every chunk hash"),
        ("PutChunks", phases["put_s"], "stream; writer threads re-hash, write + fsync each blob"),
        ("PushReply", phases["push_s"], "coordinator re-reads each chunk, checks finite, records"),
        ("  sha256, 1 thread", median["sha256_s"], "one pass over the bytes (done 2x on the path)"),
        ("  sha256, pool", median["sha256_pool_s"], "the same on split_message's thread pool"),
        ("  blob put_stream", median["blob_put_s"], f"BlobStore.put_stream of every chunk ({parts['filesystem']})"),
        ("  of which fsync", median["fsync_s"], "put_stream minus put_stream with fsync a no-op"),
        ("  durable floor", median["durable_floor_s"],
         f"write + fsync only, {WRITERS} threads: raw/floor = {tput['median_s']['raw'] / median['durable_floor_s']:.2f}"),
        ("  PushReply work", median["push_reply_work_s"],
         f"server.replies.check_reply, no RPC; holds {parts['push_reply_peak_updates']:.1f} updates"),
        ("  SQLite per push", median["sqlite_per_push_s"], "3 authenticates, outbound, run, add_reply, audit"),
    ]
    for step, seconds, what in rows:
        table.add_row(step, f"{seconds:.3f}", what)
    console.print(table)
    table = Table(title=f"coordinator RSS while {mem['sites']} sites push {mem['update_mb']:.0f} MB each at once")
    for column in ("idle MB", "peak MB", "extra MB", "extra updates", "VmHWM MB", "1 s after MB",
                   "PushReply at once", "wall s"):
        table.add_column(column, justify="right")
    table.add_row(
        f"{mem['idle_mb']:.0f}", f"{mem['peak_mb']:.0f}", f"{mem['peak_extra_mb']:.0f}",
        f"{mem['peak_extra_updates']:.2f}", f"{mem['vmhwm_mb']:.0f}", f"{mem['after_mb']:.0f}",
        str(mem["max_concurrent"]["PushReply"]), f"{mem['wall_s']:.1f}",
    )
    console.print(table)
    console.print(
        f"peak extra {mem['peak_extra_updates']:.2f} updates: {verdict(mem['goal_met'])} (goal < "
        f"{GOAL_EXTRA_UPDATES:g}); all accepted: {verdict(mem['checks']['passed'], 'PASS', 'FAIL')}"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    tput, parts, mem = summary["throughput"], summary["components"], summary["memory"]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(16, 4.5))
    left.bar([0, 1], [tput["gib_per_s"]["hydrafl"], tput["gib_per_s"]["raw"]], color=["tab:blue", "tab:gray"])
    left.set_xticks([0, 1], ["hydrafl", "raw gRPC"])
    left.set_ylabel("GiB/s (site side, loopback)")
    left.set_title(f"hydrafl/raw = {tput['ratio_hydrafl_over_raw']:.2f} (goal >= {GOAL_RATIO:g})")
    phases, median = tput["hydrafl_phases_median_s"], parts["median_s"]
    names = ["split", "HasChunks", "PutChunks", "PushReply", "sha256", "blob puts", "fsync", "PushReply\nwork"]
    values = [phases["split_s"], phases["has_s"], phases["put_s"], phases["push_s"], median["sha256_s"],
              median["blob_put_s"], median["fsync_s"], median["push_reply_work_s"]]
    middle.barh(names[::-1], values[::-1], color=["tab:orange"] * 4 + ["tab:blue"] * 4)
    middle.axvline(tput["median_s"]["raw"], color="gray", linestyle=":", label="raw stream, whole update")
    middle.set_xlabel("seconds")
    middle.set_title(f"hydrafl phases (blue) and components (orange), {tput['update_bytes'] / GIB:g} GiB")
    middle.legend()
    trace = np.array(mem["rss_trace"])
    right.plot(trace[:, 0], trace[:, 1], color="tab:blue", label="coordinator RSS")
    for k, style in ((1, "--"), (GOAL_EXTRA_UPDATES, ":")):
        level = mem["idle_mb"] + k * mem["update_mb"]
        right.axhline(level, color="gray", linestyle=style, label=f"idle + {k:g} updates")
    for start, end in mem["push_windows"]:
        right.axvspan(start, end, color="tab:orange", alpha=0.08)
    right.set_xlim(left=min(-1.0, trace[0, 0]))
    right.set_xlabel("seconds since the pushes started (orange: PushReply calls)")
    right.set_ylabel("MB")
    right.set_title(
        f"{mem['sites']} sites x {mem['update_mb']:.0f} MB: peak extra {mem['peak_extra_updates']:.1f} updates"
    )
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def throughput_on_tmpfs(scale: Scale, raw: ServerProcess) -> dict[str, Any] | None:
    """The throughput run against a coordinator whose database and blobs live in /dev/shm (None without it)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        return None
    with tempfile.TemporaryDirectory(prefix="hydrafl-wire-", dir=shm) as tmp:
        work = Path(tmp)
        with ServerProcess("coordinator", *coordinator_args(work), log_path=work / "coordinator.log") as coordinator:
            coordinator.wait_ready()
            return throughput(scale, new_federation(work, 1), coordinator, raw)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-wire-") as tmp:
        work = Path(tmp)
        (work / "components").mkdir()
        # both import in parallel; the coordinator serves the memory run first, while it is fresh
        with ServerProcess("coordinator", *coordinator_args(work), log_path=work / "coordinator.log") as coordinator, \
                ServerProcess("raw", log_path=work / "raw.log") as raw:
            coordinator.wait_ready()
            raw.wait_ready()
            federation = new_federation(work, scale.sites)
            memory = concurrent_memory(scale, federation, coordinator)
            summary: dict[str, Any] = {
                "benchmark": NAME,
                "quick": args.quick,
                "config": {
                    "update_bytes": scale.update_bytes, "arrays": ARRAYS, "chunk_bytes": CHUNK_BYTES,
                    "reps": scale.reps, "component_reps": scale.component_reps, "sites": scale.sites,
                    "site_bytes": scale.site_bytes, "cpus": psutil.cpu_count(),
                },
                "throughput": throughput(scale, federation, coordinator, raw),
                "memory": memory,
            }
            summary["throughput_tmpfs"] = throughput_on_tmpfs(scale, raw)
        summary["components"] = components(scale, work / "components")
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
