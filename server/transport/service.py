"""The coordinator's gRPC service: every call authenticated, every bad input a clear status, state untouched.

The coordinator trusts a site's token for who it is and nothing else the site sends: which message a reply
answers, from which node, of which type, all come from the message stored for that site; a reply is checked
completely (`replies.check_reply`) before it is accepted; each site's calls, streams and unreferenced uploads
are bounded (`limits`), so one site can neither fail a round for the others nor starve them. Who is calling:
`authentication`; what a site may download and upload: `uploads`; the methods' registration: `handlers`.

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
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

import grpc
import numpy as np

from hydrafl.bounded import bounded
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import ChunkView
from hydrafl.proto.envelope import (
    CHUNK_BYTES,
    INLINE_BYTES,
    EnvelopeError,
    chunk_hashes,
    chunk_sizes,
)
from hydrafl.protocol import GRPC_OPTIONS, WEIGHT
from hydrafl.server.audit import record_refusal
from hydrafl.server.blobs import BlobStore
from hydrafl.server.retention import was_swept
from hydrafl.server.store import FIRST_NODE_ID, Store
from hydrafl.server.tables import OutboundMessage, Site
from hydrafl.server.transport import limits as bounds
from hydrafl.server.transport.authentication import SiteAuthenticator
from hydrafl.server.transport.mailbox import Mailbox
from hydrafl.server.transport.replies import as_stored, check_reply, reply_event
from hydrafl.server.transport.uploads import SiteUploads

log = logging.getLogger(__name__)

POLL_AFTER_S = 0.2
MAX_LONG_POLL_S = 20.0
"""The longest a PullMessage waits for a message, whatever the site asks (well inside gRPC's keepalives)."""
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *GRPC_OPTIONS,
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.so_reuseport", 0),
)
"""The sites' channel options, plus: idle sites may keep their connections alive, and no SO_REUSEPORT (gRPC's
default, which lets a second coordinator bind the same port without an error)."""


class CoordinatorService:
    def __init__(
        self, store: Store, blobs: BlobStore, limits: bounds.SiteLimits = bounds.SiteLimits()
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.limits = limits
        self.guard = bounds.CallGuard(limits)
        self.callers = SiteAuthenticator(store, limits)
        self.uploads = SiteUploads(store, blobs, limits.max_model_bytes)
        self.latencies: dict[tuple[str, str], list[float]] = {}
        """(site name, call) -> seconds the coordinator spent on each PutChunks stream / PushReply."""
        self.mailbox = Mailbox(slots=limits.handler_threads // 2)
        """Long polls wait here; the grid posts each stored message and the driver waits for replies."""
        self._lock = threading.Lock()
        self._joined: dict[int, str] = {}
        """Node id -> the connection (gRPC peer) it last joined on: a site asks Join again for each run's config."""
        self._served_runs: dict[int, set[int]] = {}
        """Node id -> the runs this process sent it a message of (whose status it may ask)."""

    def stop(self) -> None:
        self.mailbox.close()
        self.guard.stop()

    def connected_nodes(self, within_s: float = 30.0) -> list[int]:
        return self.callers.connected_nodes(within_s)

    def seconds_since_seen(self) -> dict[int, float]:
        return self.callers.seconds_since_seen()

    @contextmanager
    def _bounded(
        self, site: Site, context: grpc.ServicerContext, *, stream: bool = False
    ) -> Iterator[Any]:  # the stream's handle (`touch`) when `stream`
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
        site = self.callers.site(context)
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
                app_bundle=(self.store.app_bundle(run.id) if run else None) or b"",
            )

    def PullMessage(
        self, request: pb.PullMessageRequest, context: grpc.ServicerContext
    ) -> pb.PullMessageReply:
        """The site's next message; with none and `wait_s`, a long poll: the answer comes when a message is
        stored for the site (or the wait ends), and `poll_after_s` 0 tells the site to ask again at once."""
        site = self.callers.site(context)
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
                if self.uploads.ledger.pending_bytes(
                    site.node_id
                ):  # nothing left to answer: its pending uploads expire
                    self.uploads.free(site.node_id)
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
        site = self.callers.site(context)
        with self._bounded(site, context, stream=True) as stream:
            wanted = list(dict.fromkeys(request.digests))  # a repeated digest is sent once
            downloadable = self.uploads.downloadable(site.node_id)
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
        site = self.callers.site(context)
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
        site = self.callers.site(context)
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
        quota = self.uploads.quota(site.node_id)
        if not quota.nbytes:
            self.uploads.free(site.node_id)
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
                    self.uploads.ledger.reserve(site.node_id, chunk.digest, len(chunk.data), quota)
                yield chunk.digest, chunk.data

        try:
            return uploads.put_stream(received())
        except EnvelopeError as error:
            self.uploads.free(site.node_id)
            self._reject(context, site, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except bounds.LimitExceeded as error:
            self.uploads.free(site.node_id)
            self._reject(context, site, grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))

    def PushReply(
        self, request: pb.PushReplyRequest, context: grpc.ServicerContext
    ) -> pb.PushReplyReply:
        site = self.callers.site(context)
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
            with self.uploads.lock(site.node_id):
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
            self.uploads.free(site.node_id)
            refused = pb.Envelope(
                error_code=1, error_reason=f"the coordinator refused this reply: {error}"
            )
            self.store.add_reply(outbound, as_stored(refused, outbound, sent).SerializeToString())
            self.mailbox.reply_stored()
            self._reject(
                context, site, grpc.StatusCode.INVALID_ARGUMENT, str(error), answering=outbound
            )
        stored = as_stored(envelope, outbound, sent)
        uploads.sync()  # the chunks are durable before the row that refers to them
        event = reply_event(site, outbound, stored)
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
            self.uploads.ledger.referenced(site.node_id, set(chunk_hashes(stored)))
        return accepted

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
