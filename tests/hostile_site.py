"""A real site agent that rewrites every reply before upload, one attack per message, and logs what the
coordinator answered (one JSON line per attack). Run as a process: python tests/hostile_site.py ADDRESS TOKEN LOG."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from hydrafl.client.agent import SiteAgent
from hydrafl.client.site_app import client_app
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import CHUNK_BYTES, UPLOADED, split_message

TRAIN_ATTACKS = (
    "smuggle-array-in-content",
    "forge-another-site",
    "repeat-one-chunk",
    "huge-zero-size-dimension",
    "nan",
)
EVALUATE_ATTACKS = (
    "no-metrics",
    "nan-loss-forged-metadata",
    "object-array-in-content",
    "evaluate-with-arrays",
)


class HostileAgent(SiteAgent):
    def __init__(self, *args, log_path: Path, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.log_path = log_path
        self.attacks = {"train": 0, "evaluate": 0}

    def _push(self, stub: CoordinatorClient, reply: Message, server_round: int) -> None:
        kind = reply.metadata.message_type
        if kind not in self.attacks or reply.has_error():
            super()._push(stub, reply, server_round)
            return
        attacks = TRAIN_ATTACKS if kind == "train" else EVALUATE_ATTACKS
        attack = attacks[self.attacks[kind] % len(attacks)]
        self.attacks[kind] += 1
        envelope, chunks = split_message(reply, server_round)
        envelope, chunks = getattr(self, "_" + attack.replace("-", "_"))(envelope, chunks, reply)
        started = time.perf_counter()
        outcome = {"attack": attack, "round": server_round, "code": "OK", "details": ""}
        if chunks:  # a refused upload does not stop the push: the push itself must be refused
            try:
                stub.PutChunks(iter(chunks.items()), metadata=self.metadata)
            except grpc.RpcError as error:
                outcome["upload"] = error.code().name
        try:
            stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=self.metadata)
        except grpc.RpcError as error:
            outcome.update(code=error.code().name, details=error.details())
        outcome["seconds"] = time.perf_counter() - started
        with self.log_path.open("a") as log:
            log.write(json.dumps(outcome) + "\n")
        if (
            attack == "forge-another-site"
        ):  # its own message is still open: answer it with garbage too
            garbage = pb.Envelope(
                reply_to_message_id=reply.metadata.reply_to_message_id, content=b"\xff\x00garbage"
            )
            try:
                stub.PushReply(pb.PushReplyRequest(envelope=garbage), metadata=self.metadata)
            except grpc.RpcError:
                pass

    @staticmethod
    def _smuggle_array_in_content(envelope, chunks, reply):
        """A tiny array that declares the global shapes, placed in the content (Flower would broadcast it)."""
        smuggled = RecordDict({"metrics": reply.content["metrics"]})
        smuggled["arrays"] = ArrayRecord(
            {
                name: Array(
                    dtype=a.dtype,
                    shape=tuple(a.shape),
                    stype=a.stype,
                    data=Array(np.ones(1, a.dtype)).data,
                )
                for name, a in reply.content["arrays"].items()
            }
        )
        del envelope.arrays[:]
        envelope.content = recorddict_to_proto(smuggled).SerializeToString()
        return envelope, {}

    def _forge_another_site(self, envelope, chunks, reply):
        """Answer another site's message (ids are predictable: run-round-type-node-seq)."""
        run, rnd, kind, node, seq = reply.metadata.reply_to_message_id.split("-")
        other = int(node) - 1 if int(node) > 10_001 else int(node) + 1
        envelope.reply_to_message_id = f"{run}-{rnd}-{kind}-{other}-{seq}"
        return envelope, chunks

    @staticmethod
    def _repeat_one_chunk(envelope, chunks, reply):
        """One uploaded chunk listed thousands of times: a tensor of 8 GiB declared."""
        chunk = b"\0" * CHUNK_BYTES
        tensor = envelope.arrays[0].tensors[0]
        tensor.shape[:] = [8 << 10, CHUNK_BYTES // 4]
        tensor.dtype, tensor.nbytes = "float32", 8 << 30
        tensor.chunk_digests[:] = [UPLOADED.digest(chunk)] * (8 << 10)
        return envelope, {UPLOADED.digest(chunk): chunk}

    @staticmethod
    def _huge_zero_size_dimension(envelope, chunks, reply):
        tensor = envelope.arrays[0].tensors[0]
        tensor.shape[:] = [0, 10**17]
        tensor.nbytes = 0
        del tensor.chunk_digests[:]
        return envelope, chunks

    @staticmethod
    def _nan(envelope, chunks, reply):
        record = reply.content["arrays"]
        poisoned = {
            name: np.full(a.shape, np.nan, dtype=a.dtype)
            for name, a in ((n, x.numpy()) for n, x in record.items())
        }
        reply.content = RecordDict(
            {
                "arrays": ArrayRecord({n: Array(v) for n, v in poisoned.items()}),
                "metrics": reply.content["metrics"],
            }
        )
        return split_message(reply, envelope.round)

    @staticmethod
    def _no_metrics(envelope, chunks, reply):
        envelope.content = recorddict_to_proto(RecordDict()).SerializeToString()
        return envelope, chunks

    @staticmethod
    def _nan_loss_forged_metadata(envelope, chunks, reply):
        metrics = MetricRecord({**dict(reply.content["metrics"]), "loss": float("nan")})
        envelope.content = recorddict_to_proto(RecordDict({"metrics": metrics})).SerializeToString()
        envelope.metadata = b"\x08\x01\x12\x05forge"  # not what the coordinator reads
        return envelope, chunks

    @staticmethod
    def _object_array_in_content(envelope, chunks, reply):
        content = RecordDict(
            {
                "metrics": reply.content["metrics"],
                "x": ArrayRecord(
                    {"x": Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=b"\x80")}
                ),
            }
        )
        envelope.content = recorddict_to_proto(content).SerializeToString()
        return envelope, chunks

    @staticmethod
    def _evaluate_with_arrays(envelope, chunks, reply):
        values = np.ones(4, dtype=np.float32)
        reply.content = RecordDict(
            {"metrics": reply.content["metrics"], "arrays": ArrayRecord({"w": Array(values)})}
        )
        return split_message(reply, envelope.round)


if __name__ == "__main__":
    logging.basicConfig(
        level=logging.INFO, format="%(message)s"
    )  # "joined as ..." tells the test it is connected
    address, token, log_path = sys.argv[1:4]
    HostileAgent(address, token, client_app, {}, demo=True, log_path=Path(log_path)).run()
