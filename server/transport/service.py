"""The coordinator's gRPC service: every call authenticated, every bad input a clear status, state untouched.

The coordinator trusts a site's token for who it is and nothing else the site sends: which message a reply
answers, from which node, of which type, all come from the message stored for that site; a reply is checked
completely (`replies.check_reply`) before it is accepted; each site's calls, streams and unreferenced uploads
are bounded (`limits`), so one site can neither fail a round for the others nor starve them.

Status codes: wrong, missing or revoked token, or a client certificate of another site -> UNAUTHENTICATED; a
reply to another site's message, a download of a chunk not addressed to this site -> PERMISSION_DENIED; a
reply to a closed message, to a round already swept (`retention`) or to a finished run, an upload with nothing to
answer -> FAILED_PRECONDITION; malformed request bytes, manifest, chunk hash mismatch, NaN/Inf, records a reply
may not hold, a tensor the site was not sent -> INVALID_ARGUMENT with the reason; too many calls, streams, failed
logins or unreferenced upload bytes -> RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import HealthServicer

from hydrafl.bounded import bounded
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import ChunkView, decode_chunk
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    INLINE_BYTES,
    MAX_REASON_CHARS,
    EnvelopeError,
    chunk_hashes,
    chunk_sizes,
)
from hydrafl.protocol import GRPC_OPTIONS, WEIGHT
from hydrafl.server.audit import record_refusal
from hydrafl.server.blobs import BlobStore
from hydrafl.server.retention import was_swept
from hydrafl.server.store import FIRST_NODE_ID, AuditEvent, OutboundMessage, Site, Store, hash_token
from hydrafl.server.transport import limits as bounds
from hydrafl.server.transport.mailbox import Mailbox
from hydrafl.server.transport.replies import allowed_reply_bytes, allowed_reply_chunks, check_reply

log = logging.getLogger(__name__)

POLL_AFTER_S = 0.2
MAX_LONG_POLL_S = 20.0
"""The longest a PullMessage waits for a message, whatever the site asks (well inside gRPC's keepalives)."""
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *GRPC_OPTIONS,
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
)
"""The sites' channel options, plus: idle sites may keep their connections alive, and no SO_REUSEPORT (gRPC's
default, which lets a second coordinator bind the same port without an error)."""
Request = TypeVar("Request")


class CoordinatorService:
    def __init__(
        self, store: Store, blobs: BlobStore, limits: bounds.SiteLimits = bounds.SiteLimits()
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.limits = limits
        self.guard = bounds.CallGuard(limits)
        self.throttle = bounds.AuthThrottle(limits, store.token_hashes)
        self.ledger = bounds.UploadLedger()
        self.last_seen: dict[int, float] = {}
        self.latencies: dict[tuple[str, str], list[float]] = {}
        """(site name, call) -> seconds the coordinator spent on each PutChunks stream / PushReply."""
        self.mailbox = Mailbox(slots=limits.handler_threads // 2)
        """Long polls wait here; the grid posts each stored message and the driver waits for replies."""
        self._lock = threading.Lock()
        self._joined: dict[int, str] = {}
        """Node id -> the connection (gRPC peer) it last joined on: a site asks Join again for each run's config."""
        self._served_runs: dict[int, set[int]] = {}
        """Node id -> the runs this process sent it a message of (whose status it may ask)."""
        self._message_chunks: OrderedDict[str, tuple[frozenset[str], bounds.UploadQuota]] = (
            OrderedDict()
        )
        """Outbound message id -> (its chunks, what a reply may upload), for the recent messages."""
        self._upload_locks: dict[int, threading.RLock] = {}
        """Per site: held by a push from its check until its chunks are referenced, and by freeing the site's
        pending uploads, so that a concurrent failure of the same site never deletes what a push accepts."""

    def stop(self) -> None:
        self.mailbox.close()
        self.guard.stop()

    def connected_nodes(self, within_s: float = 30.0) -> list[int]:
        """Sites that called in recently and are still enrolled."""
        horizon = time.monotonic() - within_s
        active = {site.node_id for site in self.store.sites() if not site.revoked}
        with self._lock:
            return sorted(
                node for node, seen in self.last_seen.items() if seen >= horizon and node in active
            )

    def seconds_since_seen(self) -> dict[int, float]:
        """Node id -> seconds since the site's last authenticated call to this process (the dashboard's "last
        call"; the database keeps no record of polls)."""
        now_s = time.monotonic()
        with self._lock:
            return {node: now_s - seen for node, seen in self.last_seen.items()}

    # --- who is calling -------------------------------------------------------------------------------------

    def _site(self, context: grpc.ServicerContext) -> Site:
        peer = _peer_address(context.peer())
        headers = [value for key, value in context.invocation_metadata() if key == "authorization"]
        token = (
            headers[0][7:].strip() if len(headers) == 1 and headers[0].startswith("Bearer ") else ""
        )
        if not (
            token and self.throttle.known(hash_token(token))
        ):  # a site's own token is never throttled
            wait_s = self.throttle.blocked_for(peer)
            if wait_s:
                context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many failed authentications from this address; try again in {wait_s:.0f} s",
                )
        if not token:
            self._auth_failed(context, peer, "no 'authorization: Bearer <token>' header")
        site = self.store.authenticate(token)
        if site is None:
            self._auth_failed(context, peer, "unknown or revoked site token")
        names = _certificate_names(context)
        if names is not None and site.name not in names:
            self._auth_failed(
                context,
                peer,
                f"the client certificate ({', '.join(sorted(names))}) was not issued to site {site.name!r}",
            )
        with self._lock:
            self.last_seen[site.node_id] = time.monotonic()
        return site

    def _auth_failed(self, context: grpc.ServicerContext, peer: str, reason: str) -> None:
        reason = bounded(reason)  # it may quote the names on a peer's certificate
        failures = self.throttle.failed(peer)
        if (
            failures <= self.limits.max_auth_failures
        ):  # beyond it the address is refused without a record each time
            log.warning("authentication failed from %s: %s", peer, reason)
            kind = "auth-failed" if failures < self.limits.max_auth_failures else "auth-throttled"
            self.store.audit(kind, detail=f"{peer}: {reason}")
        context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    @contextmanager
    def _bounded(
        self, site: Site, context: grpc.ServicerContext, *, stream: bool = False
    ) -> Iterator[object]:
        try:
            with (
                self.guard.stream(site.node_id, context)
                if stream
                else self.guard.call(site.node_id) as handle
            ):
                yield handle
        except bounds.LimitExceeded as error:
            log.warning("site %s: %s", site.name, error)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, bounded(error))

    # --- the calls ------------------------------------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        site = self._site(context)
        with self._bounded(site, context):
            run = next((r for r in self.store.runs() if r.status == "running"), None)
            with self._lock:  # one line per site and connection, not per run it asks the config of
                again = self._joined.get(site.node_id) == context.peer()
                self._joined[site.node_id] = context.peer()
            log.log(
                logging.DEBUG if again else logging.INFO,
                "site %s joined (node %d)%s",
                site.name,
                site.node_id,
                f"; run {run.id} is running" if run else "",
            )
            return pb.JoinReply(
                site_name=site.name,
                node_id=site.node_id,
                run_id=run.id if run else 0,
                run_config=json.dumps(run.config if run else {}).encode(),
                site_index=site.node_id - FIRST_NODE_ID,
            )

    def PullMessage(
        self, request: pb.PullMessageRequest, context: grpc.ServicerContext
    ) -> pb.PullMessageReply:
        """The site's next message; with none and `wait_s`, a long poll: the answer comes when a message is
        stored for the site (or the wait ends), and `poll_after_s` 0 tells the site to ask again at once."""
        site = self._site(context)
        with self._bounded(site, context):
            seen = self.mailbox.version(site.node_id)
            outbound = self.store.next_message_for(site.node_id)
            waited = False
            if outbound is None and request.wait_s > 0:
                waited = self.mailbox.wait_for_mail(
                    site.node_id, seen, min(request.wait_s, MAX_LONG_POLL_S)
                )
                outbound = self.store.next_message_for(site.node_id) if waited else None
            if outbound is None:
                if self.ledger.pending_bytes(
                    site.node_id
                ):  # nothing left to answer: its pending uploads expire
                    self._free_uploads(site.node_id)
                return pb.PullMessageReply(
                    has_message=False,
                    poll_after_s=0.0 if waited else POLL_AFTER_S,
                    last_run_status=self._run_status(site.node_id, request.last_run_id),
                )
            with self._lock:
                self._served_runs.setdefault(site.node_id, set()).add(outbound.run_id)
            envelope = pb.Envelope.FromString(outbound.envelope)
            return pb.PullMessageReply(
                has_message=True, envelope=envelope, chunks=self._inline_chunks(envelope)
            )

    def _inline_chunks(self, envelope: pb.Envelope) -> list[pb.Chunk]:
        """A small message's chunks, sent with it; none for a larger one, or when one cannot be read (the site's
        GetChunks then gets the error)."""
        sizes = chunk_sizes(envelope)
        if sum(sizes.values()) > INLINE_BYTES:
            return []
        try:
            return [pb.Chunk(digest=digest, data=self.blobs.get(digest)) for digest in sizes]
        except (KeyError, EnvelopeError, OSError):
            return []

    def _run_status(self, node_id: int, run_id: int) -> str:
        """The status of the run a site last answered for, so it can say when that run ended: only the word (a
        failure's detail stays with the operators), and only of a run this process sent the site a message of
        (the run id is the site's word, and other runs are not its business)."""
        with self._lock:
            served = run_id in self._served_runs.get(node_id, ())
        return (self.store.run_status(run_id) or "") if served else ""

    def GetChunks(
        self, request: pb.GetChunksRequest, context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        """Each chunk asked for, in a Chunk's wire form (`BlobStore.wire`), which gRPC sends as it is."""
        site = self._site(context)
        with self._bounded(site, context, stream=True) as stream:
            wanted = list(dict.fromkeys(request.digests))  # a repeated digest is sent once
            downloadable = self._downloadable(site.node_id)
            outside = next((digest for digest in wanted if digest not in downloadable), None)
            if outside is not None:
                log.warning(
                    "site %s asked for chunk %s, not part of a message addressed to it",
                    site.name,
                    outside[:12],
                )
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"chunk {outside[:12]} is not part of a message addressed to this site",
                )
            for digest in wanted:
                try:
                    wire = self.blobs.wire(digest)
                except (KeyError, EnvelopeError) as error:
                    context.abort(grpc.StatusCode.NOT_FOUND, bounded(error))
                stream.touch()
                yield wire

    def HasChunks(
        self, request: pb.HasChunksRequest, context: grpc.ServicerContext
    ) -> pb.HasChunksReply:
        """Which of these chunks this site has already uploaded (its own namespace only)."""
        site = self._site(context)
        with self._bounded(site, context):
            uploads = self.blobs.uploads(site.node_id)
            wanted = list(dict.fromkeys(request.digests))
            try:
                missing = set(uploads.missing(wanted))
            except EnvelopeError as error:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded(error))
            return pb.HasChunksReply(present=[digest for digest in wanted if digest not in missing])

    def PutChunks(
        self, request_iterator: Iterator[ChunkView], context: grpc.ServicerContext
    ) -> pb.PutChunksReply:
        site = self._site(context)
        started = time.perf_counter()
        with self._bounded(site, context, stream=True) as stream:
            stored, present = self._store_uploads(site, context, request_iterator, stream.touch)
        self._timed(site, "put_chunks", started)
        return pb.PutChunksReply(stored=stored, already_present=present)

    def _store_uploads(
        self,
        site: Site,
        context: grpc.ServicerContext,
        chunks: Iterable[ChunkView | pb.Chunk],
        touch: Callable[[], None],
    ) -> tuple[int, int]:
        """Store a site's uploaded chunks in its namespace, each checked and counted against its upload quota;
        (stored, already present). A bad chunk or an exceeded quota frees its pending uploads and aborts."""
        quota = self._upload_quota(site.node_id)
        if not quota.nbytes:
            self._free_uploads(site.node_id)
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "no message this site may answer takes an upload right now",
            )
        uploads = self.blobs.uploads(site.node_id)

        def received() -> Iterator[tuple[str, bytes | memoryview]]:
            for chunk in chunks:
                touch()
                if len(chunk.data) > CHUNK_BYTES:
                    raise EnvelopeError(
                        f"chunk {chunk.digest[:12]} has {len(chunk.data)} bytes; at most {CHUNK_BYTES}"
                    )
                if not uploads.has(chunk.digest):
                    self.ledger.reserve(site.node_id, chunk.digest, len(chunk.data), quota)
                yield chunk.digest, chunk.data

        try:
            return uploads.put_stream(received())
        except EnvelopeError as error:
            self._free_uploads(site.node_id)
            self._reject(context, site, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except bounds.LimitExceeded as error:
            self._free_uploads(site.node_id)
            self._reject(context, site, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    def PushReply(
        self, request: pb.PushReplyRequest, context: grpc.ServicerContext
    ) -> pb.PushReplyReply:
        site = self._site(context)
        started = time.perf_counter()
        with self._bounded(site, context):
            envelope = request.envelope
            outbound = self.store.outbound(envelope.reply_to_message_id)
            if outbound is None and was_swept(
                self.store, envelope.reply_to_message_id, site.node_id
            ):
                self._reject(
                    context,
                    site,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    "its round is over; late reply refused",
                )
            if outbound is None or outbound.node_id != site.node_id:
                self._reject(
                    context,
                    site,
                    grpc.StatusCode.PERMISSION_DENIED,
                    "reply to a message not addressed to this site",
                )
            if outbound.closed:
                self._reject(
                    context,
                    site,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"round {outbound.server_round} closed at its deadline; late reply refused",
                )
            if self.store.run(outbound.run_id).status != "running":
                self._reject(
                    context,
                    site,
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"run {outbound.run_id} is not running",
                )
            sent = pb.Envelope.FromString(outbound.envelope)
            with self._upload_lock(site.node_id):
                accepted = self._accept_reply(site, context, request, outbound, sent)
        self._timed(site, "push_reply", started)
        return pb.PushReplyReply(duplicate=not accepted)

    def _accept_reply(
        self,
        site: Site,
        context: grpc.ServicerContext,
        request: pb.PushReplyRequest,
        outbound: OutboundMessage,
        sent: pb.Envelope,
    ) -> bool:
        """Check the reply against `sent` and store it; whether it was new (False: a duplicate push)."""
        envelope = request.envelope
        if request.chunks:
            if outbound.message_id not in {
                m.message_id for m in self.store.open_messages_for(site.node_id)
            }:
                return (
                    False  # answered already: a repeated push is a duplicate, as a streamed one is
                )
            self._store_uploads(site, context, request.chunks, touch=lambda: None)
        uploads = self.blobs.uploads(site.node_id)
        try:
            check_reply(
                envelope,
                sent,
                chunk_size=uploads.size,
                chunk_bytes=uploads.get,
                weighted_by_key=WEIGHT,
                max_model_bytes=self.limits.max_model_bytes,
                known_finite=uploads.finite_float32,
            )
        except (
            EnvelopeError
        ) as error:  # final: the site failed this message, the round need not wait for it
            self._free_uploads(site.node_id)
            refused = pb.Envelope(
                error_code=1, error_reason=f"the coordinator refused this reply: {error}"
            )
            self.store.add_reply(outbound, _as_stored(refused, outbound, sent).SerializeToString())
            self.mailbox.reply_stored()
            self._reject(
                context, site, grpc.StatusCode.INVALID_ARGUMENT, str(error), answering=outbound
            )
        stored = _as_stored(envelope, outbound, sent)
        uploads.sync()  # the chunks are durable before the row that refers to them
        event = _reply_event(site, outbound, stored)
        accepted = self.store.add_reply(outbound, stored.SerializeToString(), event=event)
        if (
            not accepted and self.store.outbound(outbound.message_id) is None
        ):  # swept while being checked
            self._reject(
                context,
                site,
                grpc.StatusCode.FAILED_PRECONDITION,
                "its round is over; late reply refused",
            )
        self.mailbox.reply_stored()
        if accepted:
            self.ledger.referenced(site.node_id, set(chunk_hashes(stored)))
        return accepted

    # --- bounds ---------------------------------------------------------------------------------------------

    def _open_messages(self, node_id: int) -> list[tuple[frozenset[str], bounds.UploadQuota]]:
        """(chunks, what a reply may upload) of each message this site may still answer."""
        described = []
        for message in self.store.open_messages_for(node_id):
            with self._lock:
                known = self._message_chunks.get(message.message_id)
            if known is None:
                sent = pb.Envelope.FromString(message.envelope)
                allowed = bounds.UploadQuota(
                    allowed_reply_bytes(sent, self.limits.max_model_bytes),
                    allowed_reply_chunks(sent, self.limits.max_model_bytes),
                )
                known = frozenset(chunk_hashes(sent)), allowed
                with self._lock:
                    self._message_chunks[message.message_id] = known
                    while len(self._message_chunks) > 4096:
                        self._message_chunks.popitem(last=False)
            described.append(known)
        return described

    def _downloadable(self, node_id: int) -> frozenset[str]:
        return frozenset().union(*(chunks for chunks, _ in self._open_messages(node_id)))

    def _upload_quota(self, node_id: int) -> bounds.UploadQuota:
        allowed = [quota for _, quota in self._open_messages(node_id)]
        return bounds.UploadQuota(
            sum(quota.nbytes for quota in allowed), sum(quota.chunks for quota in allowed)
        )

    def _free_uploads(self, node_id: int) -> None:
        """Delete the site's uploads that no accepted reply references (a failed or expired push)."""
        uploads = self.blobs.uploads(node_id)
        with self._upload_lock(node_id):
            for digest in self.ledger.release(node_id):
                uploads.delete(digest)

    def _upload_lock(self, node_id: int) -> threading.RLock:
        with self._lock:
            return self._upload_locks.setdefault(node_id, threading.RLock())

    # --- records --------------------------------------------------------------------------------------------

    def _timed(self, site: Site, call: str, started: float) -> None:
        with self._lock:
            self.latencies.setdefault((site.name, call), []).append(time.perf_counter() - started)

    def latency_table(self) -> str:
        """Per-site P50/P99 of upload streams and reply pushes, as TSV."""
        rows = ["site\tcall\tcount\tp50_ms\tp99_ms"]
        with self._lock:
            for (name, call), seconds in sorted(self.latencies.items()):
                p50, p99 = np.percentile(np.array(seconds) * 1e3, [50, 99])
                rows.append(f"{name}\t{call}\t{len(seconds)}\t{p50:.2f}\t{p99:.2f}")
        return "\n".join(rows) + "\n"

    def _reject(
        self,
        context: grpc.ServicerContext,
        site: Site,
        code: grpc.StatusCode,
        reason: str,
        *,
        answering: OutboundMessage | None = None,
    ) -> NoReturn:
        """Refuse with `reason` cut to MAX_DETAIL_CHARS, counted on the site's audit row of its round (`audit`)."""
        reason = bounded(reason)
        log.warning("refused %s from site %s: %s", code.name, site.name, reason)
        where = (answering.run_id, answering.server_round) if answering else (None, None)
        record_refusal(self.store, site.name, f"{code.name}: {reason}", *where)
        context.abort(code, reason)


def _reply_event(site: Site, outbound: OutboundMessage, stored: pb.Envelope) -> AuditEvent:
    """The audit event of a stored reply: an accepted update, or the site's declining with its reason."""
    if stored.error_reason or stored.error_code:
        detail = bounded(
            f"round {outbound.server_round} {stored.message_type}: {stored.error_reason}"
        )
        return AuditEvent(
            kind="site-declined", site_name=site.name, run_id=outbound.run_id, detail=detail
        )
    return AuditEvent(
        kind="update-accepted",
        site_name=site.name,
        run_id=outbound.run_id,
        detail=outbound.message_id,
    )


def _as_stored(reply: pb.Envelope, outbound: OutboundMessage, sent: pb.Envelope) -> pb.Envelope:
    """The reply as the coordinator keeps it: identity from the message it answers, never from the site."""
    stored = pb.Envelope(
        message_id=f"{outbound.message_id}.reply",
        reply_to_message_id=outbound.message_id,
        message_type=sent.message_type,
        run_id=outbound.run_id,
        round=outbound.server_round,
    )
    if reply.error_code or reply.error_reason:
        stored.error_code = reply.error_code or 1
        stored.error_reason = reply.error_reason[:MAX_REASON_CHARS]
    else:
        stored.content = reply.content
        stored.arrays.extend(reply.arrays)
    return stored


def _peer_address(peer: str) -> str:
    """The client's address without its port: 'ipv4:10.0.0.5:51234' -> 'ipv4:10.0.0.5'."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return f"{kind}:{rest.rpartition(':')[0]}"
    return peer


def _certificate_names(context: grpc.ServicerContext) -> set[str] | None:
    """The names on the client certificate (common name and subject alternative names), None when the client
    presented none (no mutual TLS): with mutual TLS a certificate authenticates only the site it names."""
    auth = context.auth_context()
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    if "x509_pem_cert" not in auth and not names:
        return None
    return {name.decode(errors="replace") for name in names}


def _parse(
    parse: Callable[[bytes], Request], name: str, data: bytes, context: grpc.ServicerContext
) -> Request:
    try:
        return parse(data)
    except (DecodeError, ValueError, RuntimeError) as error:
        log.warning("malformed %s from %s: %s", name, context.peer(), bounded(error))
        context.abort(
            grpc.StatusCode.INVALID_ARGUMENT, f"malformed {name}: not a valid protobuf message"
        )


def add_coordinator_service(
    service: CoordinatorService, health: HealthServicer, server: grpc.Server
) -> None:
    """Register the service and gRPC's standard health service with request bytes parsed here, so garbage bytes
    get INVALID_ARGUMENT and one log line (gRPC's own deserializer answers INTERNAL with a traceback)."""

    def unary(method: Callable, kind: type[ProtoMessage]) -> Callable:
        return lambda data, context: method(
            _parse(kind.FromString, kind.__name__, data, context), context
        )

    def client_stream(
        method: Callable,
    ) -> Callable:  # chunks read in place (`chunk_wire`), not copied out
        return lambda items, context: method(
            (_parse(decode_chunk, "Chunk", data, context) for data in items), context
        )

    def serialize(message: ProtoMessage) -> bytes:
        return message.SerializeToString()

    handlers = {
        "Join": grpc.unary_unary_rpc_method_handler(
            unary(service.Join, pb.JoinRequest), response_serializer=serialize
        ),
        "PullMessage": grpc.unary_unary_rpc_method_handler(
            unary(service.PullMessage, pb.PullMessageRequest), response_serializer=serialize
        ),
        "GetChunks": grpc.unary_stream_rpc_method_handler(
            unary(service.GetChunks, pb.GetChunksRequest), response_serializer=bytes
        ),
        "HasChunks": grpc.unary_unary_rpc_method_handler(
            unary(service.HasChunks, pb.HasChunksRequest), response_serializer=serialize
        ),
        "PutChunks": grpc.stream_unary_rpc_method_handler(
            client_stream(service.PutChunks), response_serializer=serialize
        ),
        "PushReply": grpc.unary_unary_rpc_method_handler(
            unary(service.PushReply, pb.PushReplyRequest), response_serializer=serialize
        ),
    }
    check = health_pb2.HealthCheckRequest
    health_handlers = {
        "Check": grpc.unary_unary_rpc_method_handler(
            unary(health.Check, check), response_serializer=serialize
        ),
        "Watch": grpc.unary_stream_rpc_method_handler(
            unary(health.Watch, check), response_serializer=serialize
        ),
    }
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),
            grpc.method_handlers_generic_handler(
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, health_handlers
            ),
        )
    )
