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
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks._wire_components import components
from hydrafl.benchmarks._wire_download import download_throughput
from hydrafl.benchmarks._wire_floor import raw_beside_floor
from hydrafl.benchmarks._wire_memory import concurrent_memory
from hydrafl.benchmarks._wire_pairs import paired_runs, rates
from hydrafl.benchmarks._wire_report import GIB, GOAL_RATIO, plot, print_tables
from hydrafl.benchmarks._wire_server import RAW_METHOD, ServerProcess
from hydrafl.benchmarks._wire_setup import (
    ARRAYS,
    FULL,
    QUICK,
    Federation,
    Scale,
    auth,
    channel,
    coordinator_args,
    make_update,
    new_federation,
    pull_request,
    raw_push,
    reply_to,
    send_request,
)
from hydrafl.client.upload import upload_reply
from hydrafl.malloc_tuning import keep_freed_memory
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import CHUNK_BYTES, INLINE_BYTES
from hydrafl.server.transport.grid import CoordinatorGrid

NAME = "wire"
PHASES = ("ask_s", "put_s", "push_s")
THROUGHPUT_ROUND = 2
"""The throughput reps' requests take rounds 2, 3, ... (the memory run's are round 1)."""


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
    record = stored.content.array_records["arrays"]
    exact = [np.array_equal(record[f"w{i:02d}"].numpy(), array) for i, array in enumerate(arrays)]
    return {
        "seconds": seconds,
        **{f"{phase}_s": value for phase, value in uploaded.seconds.items()},
        "stored": uploaded.stored,
        "already_present": uploaded.already_present,
        "accepted": not uploaded.duplicate,
        "byte_exact": all(exact) and len(record) == len(arrays),
    }


def throughput(
    scale: Scale, federation: Federation, coordinator: ServerProcess, raw: ServerProcess
) -> dict[str, Any]:
    """Median site-side seconds of the hydrafl push and of the raw stream, same bytes, alternating order."""
    grid, (node_id, token) = federation.grid, federation.sites[0]
    arrays = make_update(scale.update_bytes, seed=0)
    with channel(coordinator.address) as hydrafl_channel, channel(raw.address) as raw_channel:
        stub = CoordinatorClient(hydrafl_channel)
        put: Callable[..., bytes] = raw_channel.stream_unary(RAW_METHOD)
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
