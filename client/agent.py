"""The site agent: connects outbound to the coordinator, pulls messages, runs the ClientApp in-process with a
persistent Context per run, and pushes replies.

Downloads fetch only the chunks the site lacks; uploads ask which chunks the coordinator already holds
first, so a retried or interrupted upload resumes instead of starting over. A dropped connection is retried
with exponential backoff; a refused token stops the agent (a revoked site must not keep knocking).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode

from hydrafl.client.policy import SitePolicy
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorStub
from hydrafl.proto.envelope import EnvelopeError, chunk_hashes, join_message, sha256, split_message

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]
MAX_IDLE_POLL_S = 2.0
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteTls:
    """PEM files: the CA that signed the coordinator's certificate, and this site's own pair for mutual TLS."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes(),
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None,
        )


class SiteRefused(RuntimeError):
    """The coordinator refused this site (unknown or revoked token, or a permission error)."""


class SiteAgent:
    def __init__(
        self,
        coordinator: str,
        token: str,
        client_app: ClientApp,
        node_config: dict,
        *,
        demo: bool = False,
        policy: SitePolicy = SitePolicy(),
        tls: SiteTls | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.client_app = client_app
        self.node_config = dict(node_config)
        self.demo = demo
        self.policy = policy
        self.tls = tls
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.contexts: dict[int, Context] = {}
        self.node_id = 0
        self.chunk_cache: dict[str, bytes] = {}
        """Chunks of the message in hand: a download cut by a dropped connection resumes with the rest."""

    def run(self, stop: threading.Event | None = None, max_backoff_s: float = 30.0) -> None:
        """Serve until `stop` is set; reconnect with backoff when the coordinator is unreachable."""
        stop = stop or threading.Event()
        backoff = 0.5
        while not stop.is_set():
            try:
                with self._channel() as channel:
                    self._serve(CoordinatorStub(channel), stop)
            except grpc.RpcError as error:
                code = error.code()
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise SiteRefused(f"{code.name}: {error.details()}") from error
                if code not in RETRYABLE:
                    raise
                log.warning("coordinator %s unreachable (%s); retrying in %.1f s", self.coordinator, code.name, backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, max_backoff_s)

    def _channel(self) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(self.coordinator, options=CHANNEL_OPTIONS)
        return grpc.secure_channel(self.coordinator, self.tls.credentials(), options=CHANNEL_OPTIONS)

    def _serve(self, stub: CoordinatorStub, stop: threading.Event) -> None:
        joined = stub.Join(pb.JoinRequest(), metadata=self.metadata)
        self.node_id = joined.node_id
        if self.demo:
            self.node_config["demo-site"] = joined.site_index
        log.info("joined as %s (node %d)", joined.site_name, joined.node_id)
        idle_wait = 0.0
        while not stop.is_set():
            pulled = stub.PullMessage(pb.PullMessageRequest(), metadata=self.metadata)
            if not pulled.has_message:  # back off while idle, so many waiting sites cost the coordinator little
                idle_wait = min(max(pulled.poll_after_s, idle_wait * 1.5), MAX_IDLE_POLL_S)
                stop.wait(idle_wait)
                continue
            idle_wait = 0.0
            envelope = pulled.envelope
            if envelope.run_id not in self.contexts:
                joined = stub.Join(pb.JoinRequest(), metadata=self.metadata)
                self.contexts[envelope.run_id] = Context(
                    run_id=envelope.run_id,
                    node_id=self.node_id,
                    node_config=self.node_config,
                    state=RecordDict(),
                    run_config=json.loads(joined.run_config or b"{}"),
                )
            reply = self._handle(stub, envelope)
            try:
                self._push(stub, reply, envelope.round)
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT):
                    raise
                # A late reply (round closed) or one the coordinator refused: drop it and take the next message.
                log.warning("coordinator refused the reply (%s): %s", error.code().name, error.details())
            self.chunk_cache.clear()

    def _handle(self, stub: CoordinatorStub, envelope: pb.Envelope) -> Message:
        missing = [digest for digest in chunk_hashes(envelope) if digest not in self.chunk_cache]
        for chunk in stub.GetChunks(pb.GetChunksRequest(sha256=missing), metadata=self.metadata):
            if sha256(chunk.data) != chunk.sha256:
                raise EnvelopeError(f"chunk {chunk.sha256[:12]} from the coordinator fails its SHA-256 check")
            self.chunk_cache[chunk.sha256] = chunk.data
        message = join_message(envelope, self.chunk_cache)
        context = self.contexts[envelope.run_id]
        refusal = self.policy.refusal(envelope.run_id, str(context.run_config.get("strategy", "")))
        if refusal:
            log.warning("declining a message of run %d: %s", envelope.run_id, refusal)
            reply = Message(Error(ErrorCode.MOD_FAILED_PRECONDITION, refusal), reply_to=message)
        else:
            try:
                reply = self.policy.apply(self.client_app(message=message, context=context))
            except Exception as error:  # the site's failure becomes an error reply; the agent keeps serving
                log.warning("ClientApp raised %s: %s", type(error).__name__, error)
                reason = f"{type(error).__name__}: {error}"
                reply = Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason), reply_to=message)
        reply.metadata.__dict__["_message_id"] = uuid.uuid4().hex
        return reply

    def _push(self, stub: CoordinatorStub, reply: Message, server_round: int) -> None:
        envelope, chunks = split_message(reply, server_round)
        present = set(stub.HasChunks(pb.HasChunksRequest(sha256=list(chunks)), metadata=self.metadata).present)
        missing = [digest for digest in chunks if digest not in present]

        def stream() -> Iterator[pb.Chunk]:
            for digest in missing:
                yield pb.Chunk(sha256=digest, data=bytes(chunks[digest]))

        if missing:
            stub.PutChunks(stream(), metadata=self.metadata)
        started = time.perf_counter()
        stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=self.metadata)
        log.info("pushed reply to %s in %.3f s", envelope.reply_to_message_id[:8], time.perf_counter() - started)
