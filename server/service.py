"""The coordinator's gRPC service: every call authenticated, every bad input a clear status, state untouched.

Status codes: wrong or revoked token -> UNAUTHENTICATED; a reply to another site's message ->
PERMISSION_DENIED; a reply to a message of a finished run -> FAILED_PRECONDITION; malformed manifest,
chunk hash mismatch, NaN/Inf, garbage bytes, a tensor larger than the one sent -> INVALID_ARGUMENT with the
reason.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator

import grpc
import numpy as np

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2_grpc import CoordinatorServicer
from hydrafl.proto.envelope import CHUNK_BYTES, EnvelopeError, check_manifest, chunk_hashes, parse_content
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import FIRST_NODE_ID, Site, Store

log = logging.getLogger(__name__)

POLL_AFTER_S = 0.2
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 8 << 20),
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
]


class CoordinatorService(CoordinatorServicer):
    def __init__(self, store: Store, blobs: BlobStore) -> None:
        self.store = store
        self.blobs = blobs
        self.last_seen: dict[int, float] = {}
        self.latencies: dict[tuple[str, str], list[float]] = {}
        """(site name, call) -> seconds the coordinator spent on each PutChunks stream / PushReply."""
        self._lock = threading.Lock()

    def connected_nodes(self, within_s: float = 30.0) -> list[int]:
        """Sites that called in recently and are still enrolled."""
        horizon = time.monotonic() - within_s
        active = {site.node_id for site in self.store.sites() if not site.revoked}
        with self._lock:
            return sorted(node for node, seen in self.last_seen.items() if seen >= horizon and node in active)

    def _site(self, context: grpc.ServicerContext) -> Site:
        metadata = dict(context.invocation_metadata())
        token = metadata.get("authorization", "").removeprefix("Bearer ").strip()
        site = self.store.authenticate(token) if token else None
        if site is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "unknown or revoked site token")
        with self._lock:
            self.last_seen[site.node_id] = time.monotonic()
        return site

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        site = self._site(context)
        run = next((r for r in self.store.runs() if r.status == "running"), None)
        return pb.JoinReply(
            site_name=site.name,
            node_id=site.node_id,
            run_id=run.id if run else 0,
            run_config=json.dumps(run.config if run else {}).encode(),
            site_index=site.node_id - FIRST_NODE_ID,
        )

    def PullMessage(self, request: pb.PullMessageRequest, context: grpc.ServicerContext) -> pb.PullMessageReply:
        site = self._site(context)
        outbound = self.store.next_message_for(site.node_id)
        if outbound is None:
            return pb.PullMessageReply(has_message=False, poll_after_s=POLL_AFTER_S)
        return pb.PullMessageReply(has_message=True, envelope=pb.Envelope.FromString(outbound.envelope))

    def GetChunks(self, request: pb.GetChunksRequest, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        self._site(context)
        for digest in request.sha256:
            try:
                data = self.blobs.get(digest)
            except (KeyError, EnvelopeError) as error:
                context.abort(grpc.StatusCode.NOT_FOUND, str(error))
            yield pb.Chunk(sha256=digest, data=data)

    def HasChunks(self, request: pb.HasChunksRequest, context: grpc.ServicerContext) -> pb.HasChunksReply:
        self._site(context)
        try:
            missing = set(self.blobs.missing(request.sha256))
        except EnvelopeError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return pb.HasChunksReply(present=[digest for digest in request.sha256 if digest not in missing])

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

    def PutChunks(self, request_iterator: Iterator[pb.Chunk], context: grpc.ServicerContext) -> pb.PutChunksReply:
        site = self._site(context)
        started = time.perf_counter()

        def received() -> Iterator[tuple[str, bytes]]:
            for chunk in request_iterator:
                if len(chunk.data) > CHUNK_BYTES:
                    raise EnvelopeError(f"chunk {chunk.sha256[:12]} has {len(chunk.data)} bytes; at most {CHUNK_BYTES}")
                yield chunk.sha256, chunk.data

        try:
            stored, present = self.blobs.put_stream(received())
        except EnvelopeError as error:
            self.store.audit("update-rejected", site_name=site.name, detail=str(error))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self._timed(site, "put_chunks", started)
        return pb.PutChunksReply(stored=stored, already_present=present)

    def PushReply(self, request: pb.PushReplyRequest, context: grpc.ServicerContext) -> pb.PushReplyReply:
        site = self._site(context)
        started = time.perf_counter()
        envelope = request.envelope
        outbound = self.store.outbound(envelope.reply_to_message_id)
        if outbound is None or outbound.node_id != site.node_id:
            self._reject(context, site, grpc.StatusCode.PERMISSION_DENIED, "reply to a message not addressed to this site")
        if outbound.closed:
            self._reject(
                context, site, grpc.StatusCode.FAILED_PRECONDITION,
                f"round {outbound.server_round} closed at its deadline; late reply refused",
            )
        if self.store.run(outbound.run_id).status != "running":
            self._reject(context, site, grpc.StatusCode.FAILED_PRECONDITION, f"run {outbound.run_id} is not running")
        try:
            self.check_reply(envelope, sent=pb.Envelope.FromString(outbound.envelope))
        except EnvelopeError as error:
            self._reject(context, site, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        accepted = self.store.add_reply(outbound, envelope.SerializeToString())
        if accepted:
            self.store.audit(
                "update-accepted", site_name=site.name, run_id=outbound.run_id, detail=envelope.reply_to_message_id
            )
        self._timed(site, "push_reply", started)
        return pb.PushReplyReply(duplicate=not accepted)

    def check_reply(self, envelope: pb.Envelope, *, sent: pb.Envelope) -> None:
        """Everything a reply must satisfy before it is stored; raises EnvelopeError saying what is wrong."""
        missing = self.blobs.missing(chunk_hashes(envelope))
        if missing:
            raise EnvelopeError(f"{len(missing)} chunks were not uploaded (first {missing[0][:12]})")
        _check_against_request(sent, envelope)
        check_manifest(envelope)
        parse_content(envelope)
        self._check_chunks(envelope)

    def _check_chunks(self, envelope: pb.Envelope) -> None:
        """Sizes add up and float values are finite, read one stored chunk at a time: the coordinator never
        holds a whole update to check it (chunks were verified against their hashes when stored)."""
        for record in envelope.arrays:
            for tensor in record.tensors:
                where = f"array {record.key}/{tensor.name}"
                floating = np.dtype(tensor.dtype).kind == "f"
                total = 0
                for digest in tensor.chunk_sha256:
                    if floating:
                        data = self.blobs.get(digest)
                        total += len(data)
                        if len(data) % np.dtype(tensor.dtype).itemsize or not np.isfinite(
                            np.frombuffer(data, dtype=tensor.dtype)
                        ).all():
                            raise EnvelopeError(f"{where} contains NaN or Inf (or a misaligned chunk)")
                    else:
                        total += self.blobs.size(digest)
                if total != tensor.nbytes:
                    raise EnvelopeError(f"{where}: chunks hold {total} bytes, manifest says {tensor.nbytes}")

    def _reject(self, context: grpc.ServicerContext, site: Site, code: grpc.StatusCode, reason: str) -> None:
        self.store.audit("update-rejected", site_name=site.name, detail=f"{code.name}: {reason}")
        context.abort(code, reason)


def _check_against_request(request: pb.Envelope, reply: pb.Envelope) -> None:
    """A reply's tensor that shares a name with one the site was sent keeps its dtype and rank and is no larger
    along any axis: the whole tensor, or the slice a subnetwork trained (which slice is the strategy's check)."""
    sent = {t.name: (t.dtype, list(t.shape)) for record in request.arrays for t in record.tensors}
    for record in reply.arrays:
        for tensor in record.tensors:
            if tensor.name not in sent:
                continue
            dtype, shape = sent[tensor.name]
            fits = len(tensor.shape) == len(shape) and all(0 <= n <= m for n, m in zip(tensor.shape, shape))
            if tensor.dtype != dtype or not fits:
                raise EnvelopeError(
                    f"array {tensor.name}: shape {list(tensor.shape)} {tensor.dtype} does not fit in shape {shape} "
                    f"{dtype} of the array sent"
                )
