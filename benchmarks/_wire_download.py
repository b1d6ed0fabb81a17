"""The download half of the wire benchmark: one model from the coordinator to a site, received the way a site
receives it (`SiteAgent._receive`: GetChunks, each chunk's checksum checked as it arrives, the Message rebuilt
with one copy of the bytes), against a raw gRPC server stream of the same number of bytes in 1 MiB messages that
the client only counts. The coordinator's side (hashing the model once, storing and syncing its chunks) happens
once per round, before any site downloads, and is timed apart as `store_s`."""

from __future__ import annotations

import gc
import statistics
import time
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.clientapp import ClientApp

from hydrafl.benchmarks._wire_pairs import paired_runs, rates
from hydrafl.benchmarks._wire_server import RAW_GET_METHOD, ServerProcess
from hydrafl.client.agent import SiteAgent
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient

if TYPE_CHECKING:
    from hydrafl.benchmarks._wire_setup import Federation, Scale

DOWNLOAD_ROUND = 1000
"""The requests of the download runs take rounds from here (the upload runs take rounds from 2)."""
MODEL_SEED = 3


def _site(address: str, token: str, update_bytes: int) -> SiteAgent:
    return SiteAgent(
        address, token, client_app=ClientApp(), node_config={}, max_download_bytes=2 * update_bytes
    )


def model_message(arrays: list[np.ndarray], node_id: int, server_round: int) -> Message:
    """A round's train message carrying `arrays` to site `node_id`."""
    record = ArrayRecord({f"w{i:02d}": Array(array) for i, array in enumerate(arrays)})
    message = Message(
        RecordDict({"arrays": record, "config": ConfigRecord({"server-round": server_round})}),
        dst_node_id=node_id,
        message_type="train",
    )
    message.metadata.group_id = str(server_round)
    return message


def hydrafl_download(
    stub: CoordinatorClient,
    agent: SiteAgent,
    federation: Federation,
    coordinator: ServerProcess,
    push: dict[str, Any],
    arrays: list[np.ndarray],
) -> dict[str, Any]:
    """Untimed: the coordinator process stores a message carrying `arrays` (`push` says how to build them).
    Timed: the site pulls it and rebuilds it."""
    stored = coordinator.ask(push)
    gc.collect()
    started = time.perf_counter()
    pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=agent.metadata)
    received = agent._receive(stub, pulled.envelope)
    seconds = time.perf_counter() - started
    federation.store.close_messages(
        [stored["message_id"]]
    )  # answered as far as this benchmark goes
    got = received.content.array_records["arrays"]
    exact = len(got) == len(arrays) and all(
        np.array_equal(got[f"w{i:02d}"].numpy(), a) for i, a in enumerate(arrays)
    )
    return {"seconds": seconds, "store_s": stored["store_s"], "byte_exact": exact}


def raw_download(get: grpc.UnaryStreamMultiCallable, nbytes: int) -> dict[str, Any]:
    gc.collect()
    started = time.perf_counter()
    received = sum(len(piece) for piece in get(nbytes.to_bytes(8, "little")))
    return {"seconds": time.perf_counter() - started, "received": received}


def download_throughput(
    scale: Scale, federation: Federation, coordinator: ServerProcess, raw: ServerProcess
) -> dict[str, Any]:
    """Median seconds of the site's receive path and of the raw stream, same bytes, alternating order."""
    from hydrafl.benchmarks._wire_report import GOAL_RATIO
    from hydrafl.benchmarks._wire_setup import channel, make_update

    arrays = make_update(scale.update_bytes, seed=MODEL_SEED)
    node_id, token = federation.sites[0]
    agent = _site(coordinator.address, token, scale.update_bytes)

    def push(
        rep: int,
    ) -> dict[str, Any]:  # the child builds the arrays the parent marked for this rep
        return {
            "nbytes": scale.update_bytes,
            "seed": MODEL_SEED,
            "mark": -(rep + 1.0),
            "node_id": node_id,
            "round": DOWNLOAD_ROUND + rep,
            "run_id": federation.grid.run.run_id,
        }

    with channel(coordinator.address) as hydrafl_channel, channel(raw.address) as raw_channel:
        stub = CoordinatorClient(hydrafl_channel)
        get: grpc.UnaryStreamMultiCallable[Any, Any] = raw_channel.unary_stream(RAW_GET_METHOD)
        runs = paired_runs(
            scale.reps,
            arrays,
            lambda rep: hydrafl_download(stub, agent, federation, coordinator, push(rep), arrays),
            lambda: raw_download(get, scale.update_bytes),
        )
    median, gib_per_s, ratio = rates(runs, scale.update_bytes)
    checks = {
        "byte_exact": all(run["byte_exact"] for run in runs["hydrafl"]),
        "raw_bytes_received": all(run["received"] == scale.update_bytes for run in runs["raw"]),
    }
    return {
        "update_bytes": scale.update_bytes,
        "reps": scale.reps,
        "runs": runs,
        "median_s": median,
        "gib_per_s": gib_per_s,
        "coordinator_store_median_s": statistics.median(run["store_s"] for run in runs["hydrafl"]),
        "ratio_hydrafl_over_raw": ratio,
        "goal": GOAL_RATIO,
        "goal_met": ratio >= GOAL_RATIO,
        "checks": {**checks, "passed": all(checks.values())},
    }
