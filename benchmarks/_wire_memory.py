"""The coordinator's memory while every site pushes one update at the same moment (`benchmarks/wire.py`)."""

from __future__ import annotations

import gc
import statistics
import threading
import time
from typing import Any

import grpc

from hydrafl.benchmarks._wire_pairs import mark
from hydrafl.benchmarks._wire_report import GOAL_EXTRA_UPDATES
from hydrafl.benchmarks._wire_server import RssSampler, ServerProcess
from hydrafl.benchmarks._wire_setup import (
    Federation,
    Scale,
    auth,
    channel,
    make_update,
    pull_request,
    push_update,
    reply_to,
    send_request,
)
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import split_message

MB = 1e6  # decimal megabytes, as in "200 MB per site"
MEMORY_ROUND = 1
"""The round the memory run's requests belong to."""


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
