"""The disk's part of an upload, alone and beside the raw stream (`benchmarks/wire.py`).

The durable write floor is what no durable upload to this disk can beat: an update's bytes written into one
preallocated file past the page cache, then one sync, with no other work. On this VM the disk's writes and a
gRPC stream slow each other down, so the wire benchmark also runs the raw stream while the coordinator's process
writes the floor (`floor_here`), both at once: what receiving and storing an update costs with no hydrafl code.
"""

from __future__ import annotations

import mmap
import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydrafl.benchmarks._wire_download import MODEL_SEED
from hydrafl.benchmarks._wire_server import RAW_METHOD, ServerProcess
from hydrafl.proto.envelope import byte_chunks
from hydrafl.server.blobs import WRITERS
from hydrafl.server.disk import open_file, preallocate, sync_filesystem
from hydrafl.server.transport.packs import HEADER_BYTES, SLOT_BYTES

if TYPE_CHECKING:
    from hydrafl.benchmarks._wire_setup import Scale


def durable_writes(chunks: dict[str, memoryview], folder: Path) -> None:
    """The disk's part and nothing else: every chunk into its slot of one preallocated file, past the page cache,
    on the blob store's pool size of threads, then one sync (the layout of `server.packs`, without checks)."""
    folder.mkdir()
    descriptor = open_file(folder / "floor.pack", os.O_RDWR | os.O_CREAT, direct=True)
    buffers = threading.local()

    def write(item: tuple[int, memoryview]) -> None:
        if not hasattr(buffers, "slot"):
            buffers.slot = mmap.mmap(-1, SLOT_BYTES)
        index, data = item
        buffers.slot[HEADER_BYTES : HEADER_BYTES + len(data)] = data
        end = HEADER_BYTES + -(-len(data) // HEADER_BYTES) * HEADER_BYTES
        os.pwrite(descriptor, memoryview(buffers.slot)[:end], index * SLOT_BYTES)

    try:
        preallocate(descriptor, 0, len(chunks) * SLOT_BYTES)
        with futures.ThreadPoolExecutor(WRITERS) as pool:
            list(pool.map(write, enumerate(chunks.values())))
    finally:
        os.close(descriptor)
    sync_filesystem(folder)


def floor_here(models: dict[tuple[int, int], list], request: dict[str, Any]) -> dict[str, Any]:
    """`durable_writes` of one model's chunks into `request["floor"]` in this process, as its packs would be
    written; seconds, then the folder removed."""
    from hydrafl.benchmarks._wire_setup import make_update

    key = (request["nbytes"], request["seed"])
    if key not in models:
        models[key] = make_update(*key)
    pieces = [piece for array in models[key] for piece in byte_chunks(memoryview(array).cast("B"))]
    chunks = {str(index): piece for index, piece in enumerate(pieces)}
    folder = Path(request["floor"])
    started = time.perf_counter()
    durable_writes(chunks, folder)
    seconds = time.perf_counter() - started
    shutil.rmtree(folder)
    return {"seconds": seconds}


def raw_beside_floor(
    scale: Scale, coordinator: ServerProcess, raw: ServerProcess, workdir: Path
) -> dict[str, Any]:
    """The raw stream while the coordinator's process writes the same bytes durably (`durable_writes`), both
    started together: what an upload that must both receive and store an update is up against on this machine,
    where the disk's writes and the stream share the cores. Median seconds until both end, and each alone."""
    from hydrafl.benchmarks._wire_setup import channel, make_update, raw_push

    arrays = make_update(scale.update_bytes, seed=MODEL_SEED)
    floor = {
        "floor": str(workdir / "floor-beside-raw"),
        "nbytes": scale.update_bytes,
        "seed": MODEL_SEED,
    }
    runs: dict[str, list[float]] = {"both": [], "raw": [], "floor": []}

    def write_floor(answer: dict[str, Any]) -> None:
        answer.update(coordinator.ask(floor))

    with channel(raw.address) as raw_channel:
        put: Callable[..., bytes] = raw_channel.stream_unary(RAW_METHOD)
        for _ in range(scale.reps):
            answer: dict[str, Any] = {}
            writer = threading.Thread(target=write_floor, args=(answer,))
            started = time.perf_counter()
            writer.start()
            runs["raw"].append(raw_push(put, arrays)["seconds"])
            writer.join()
            runs["both"].append(time.perf_counter() - started)
            runs["floor"].append(answer["seconds"])
    return {
        "runs": runs,
        "median_s": {name: statistics.median(values) for name, values in runs.items()},
    }
