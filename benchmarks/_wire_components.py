"""The pieces of hydrafl's upload path timed alone (`benchmarks/wire.py`): hashing, blob writes with and without
fsync, the durable write floor, PushReply's work between its SQLite calls, and those SQLite calls."""

from __future__ import annotations

import gc
import shutil
import statistics
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from flwr.app import Message, RecordDict

from hydrafl.benchmarks._wire_floor import durable_writes
from hydrafl.benchmarks._wire_server import filesystem
from hydrafl.benchmarks._wire_setup import UPLOAD_REQUEST, Scale, make_update, reply_to
from hydrafl.identity import claim_server_identity
from hydrafl.proto.envelope import SENT, UPLOADED, split_message
from hydrafl.protocol import WEIGHT
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.transport.limits import SiteLimits
from hydrafl.server.transport.packs import UploadPacks
from hydrafl.server.transport.replies import check_reply


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
        assert outbound is not None  # added just before
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
        timed("push_reply_work_s", partial(push_reply_work, synced))
        store.add_outbound(f"m{rep}", run.id, 1, site.node_id, b"")
        timed("sqlite_per_push_s", partial(sqlite_calls, f"m{rep}"))
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
