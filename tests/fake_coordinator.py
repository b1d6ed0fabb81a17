"""A scripted coordinator on loopback for site tests: a real gRPC server that hands out the envelopes a test
queues, answers GetChunks with what the test scripts (or honestly), and records every call the site makes."""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import (
    CoordinatorServicer,
    add_CoordinatorServicer_to_server,
)
from hydrafl.proto.envelope import UPLOADED, split_message

NODE_ID = 7
RUN_ID = 1


@dataclass
class Scripted:
    envelope: pb.Envelope
    stream: list[pb.Chunk] | None = None
    """What GetChunks answers while this message is in hand; None serves exactly the chunks asked for."""
    inline: bool = False
    """Send `stream` inline with the message (as the coordinator sends a small message's chunks) instead."""


@dataclass
class FakeCoordinator(CoordinatorServicer):
    run_configs: dict[int, bytes] = field(default_factory=dict)
    """Run id -> the run_config bytes Join returns while that run's message is in hand."""
    refuse: bool = False
    """Answer Join with UNAUTHENTICATED (after recording the token): a CLI site then exits."""
    blobs: dict[str, bytes] = field(default_factory=dict)
    outbox: queue.Queue = field(default_factory=queue.Queue)
    joins: list[str] = field(default_factory=list)
    chunk_requests: list[list[str]] = field(default_factory=list)
    replies: dict[str, pb.Envelope] = field(default_factory=dict)
    in_hand: Scripted | None = None
    port: int = 0

    def start(self) -> grpc.Server:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        add_CoordinatorServicer_to_server(self, server)
        self.port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def send(self, message: Message) -> str:
        """Queue a message, its chunks served honestly; returns its message id."""
        envelope, chunks = split_message(message, server_round=1)
        self.blobs.update({digest: bytes(view) for digest, view in chunks.items()})
        return self.send_envelope(envelope)

    def send_envelope(
        self, envelope: pb.Envelope, stream: list[pb.Chunk] | None = None, inline: bool = False
    ) -> str:
        """Queue a hand-made envelope, with what GetChunks answers while it is in hand (or, `inline`, what comes
        with it); returns its message id."""
        self.outbox.put(Scripted(envelope, stream, inline))
        return envelope.message_id

    def reply_to(self, message_id: str, alive, timeout_s: float = 20.0) -> pb.Envelope:
        """The site's reply to `message_id`; fails fast when the site's thread `alive()` says it died."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if message_id in self.replies:
                return self.replies[message_id]
            assert alive(), "the site agent died"
            time.sleep(0.02)
        raise AssertionError(f"no reply to {message_id} within {timeout_s} s")

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        self.joins.append(dict(context.invocation_metadata()).get("authorization", ""))
        if self.refuse:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        run_id = self.in_hand.envelope.run_id if self.in_hand else RUN_ID
        return pb.JoinReply(
            site_name="st-marys",
            node_id=NODE_ID,
            run_id=run_id,
            site_index=0,
            run_config=self.run_configs.get(run_id, b"{}"),
        )

    def PullMessage(
        self, request: pb.PullMessageRequest, context: grpc.ServicerContext
    ) -> pb.PullMessageReply:
        try:
            self.in_hand = self.outbox.get_nowait()
        except queue.Empty:
            return pb.PullMessageReply(has_message=False, poll_after_s=0.02)
        inline = self.in_hand.stream if self.in_hand.inline else None
        return pb.PullMessageReply(has_message=True, envelope=self.in_hand.envelope, chunks=inline)

    def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.Chunk]:
        self.chunk_requests.append(list(request.digests))
        if self.in_hand is not None and self.in_hand.stream is not None:
            yield from self.in_hand.stream
            return
        for digest in request.digests:
            yield pb.Chunk(digest=digest, data=self.blobs[digest])

    def HasChunks(
        self, request: pb.HasChunksRequest, context: grpc.ServicerContext
    ) -> pb.HasChunksReply:
        return pb.HasChunksReply(
            present=[digest for digest in request.digests if digest in self.blobs]
        )

    def PutChunks(
        self, request_iterator: Iterator[pb.Chunk], context: grpc.ServicerContext
    ) -> pb.PutChunksReply:
        return pb.PutChunksReply(stored=self._store(request_iterator))

    def _store(self, chunks: Iterable[pb.Chunk]) -> int:
        stored = 0
        for chunk in chunks:
            assert UPLOADED.digest(chunk.data) == chunk.digest
            self.blobs[chunk.digest] = chunk.data
            stored += 1
        return stored

    def PushReply(
        self, request: pb.PushReplyRequest, context: grpc.ServicerContext
    ) -> pb.PushReplyReply:
        self._store(request.chunks)
        self.replies[request.envelope.reply_to_message_id] = request.envelope
        return pb.PushReplyReply()


def coordinator_message(
    message_type: str,
    arrays: dict[str, np.ndarray] | None = None,
    config: dict | None = None,
    run_id: int = RUN_ID,
) -> Message:
    """A message as a coordinator sends it to node NODE_ID, with a fresh message id."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK_NODE_ID, 1
    content = RecordDict()
    if arrays:
        content["arrays"] = ArrayRecord({name: Array(value) for name, value in arrays.items()})
    if config:
        content["config"] = ConfigRecord(config)
    message = Message(content, dst_node_id=NODE_ID, message_type=message_type)
    message.metadata.__dict__["_message_id"] = uuid.uuid4().hex
    return message


def run_config_bytes(values: dict) -> bytes:
    return json.dumps(values).encode()


def serve_in_thread(target, *args) -> tuple[threading.Thread, list[BaseException]]:
    """Run `target(*args)` on a daemon thread; what it raises is kept in the returned list."""
    raised: list[BaseException] = []

    def body() -> None:
        try:
            target(*args)
        except BaseException as error:
            raised.append(error)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, raised
