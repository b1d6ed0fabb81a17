"""A Flower `Grid` over the coordinator's database and blob store, so the ServerApp and every strategy run
unchanged: pushing a message stores its envelope and chunks for the site to pull; pulling returns the
replies sites have pushed. Message ids are (run, round, type, site), so a round is never sent twice.
`send_and_receive` yields each reply as sites store it, decoded from the blob store only when the caller asks
for it and not kept afterwards: the coordinator holds one decoded reply at a time, however many sites answer.

A reply's metadata (who sent it, what it answers, its type) is rebuilt from the stored rows, never read from
the site's envelope; a stored reply that cannot be decoded (its chunks lost from disk) becomes that site's
error reply, so the round goes on with the other sites."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterable, Iterator

import numpy as np
from flwr.app import Error, Message, Metadata, RecordDict
from flwr.app.message.message import make_message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from hydrafl.identity import claim_server_identity
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import (
    SENT,
    XXH3,
    EnvelopeError,
    Named,
    Stored,
    byte_chunks,
    chunk_hashes,
    declared_nbytes,
    join_message,
    split_message,
)
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.tables import Reply
from hydrafl.server.transport.service import CoordinatorService
from hydrafl.server.transport.stored_replies import stored_message
from hydrafl.tensor_files import OnDiskArray

log = logging.getLogger(__name__)


class CoordinatorGrid(Grid):
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        service: CoordinatorService,
        run_id: int,
        *,
        poll_interval_s: float = 0.5,
        resident_bytes: int | None = None,
    ) -> None:
        self.store = store
        self.resident_bytes = resident_bytes
        """Replies larger than this stay in the blob store, read a tensor at a time (`stored_replies`); a driver
        keeps a global model larger than this on disk (`aggregation.streamed`). None: everything in memory."""
        self.blobs = blobs
        self.service = service
        self._run = Run.create_empty(run_id)
        self.poll_interval_s = poll_interval_s
        self._pulled: set[str] = set()
        self._sent: Counter[tuple[int, str, int]] = Counter()
        self._types: dict[str, str] = {}
        """Message id -> type of each message pushed (what its reply's type is)."""
        claim_server_identity(run_id)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return self.service.connected_nodes()

    def record_rejection(self, node_id: int, server_round: int, reason: str) -> None:
        """The driver rejected this site's reply: an audit event
        (`hydrafl.server.aggregation.screening.AuditsRejections`)."""
        name = next(
            (site.name for site in self.store.sites() if site.node_id == node_id), str(node_id)
        )
        self.store.audit(
            "update-screened",
            site_name=name,
            run_id=self._run.run_id,
            detail=f"round {server_round}: {reason}",
        )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Each message's chunks are stored, then made durable in one sync, before any row refers to them."""
        stored: list[tuple[str, int, int, bytes]] = []
        named: Named = {}  # the round's messages share the model's Arrays: each is hashed and stored once
        on_disk: Stored = {}
        put: set[str] = set()
        for message in messages:
            server_round = int(message.metadata.group_id or 0)
            # Deterministic ids: a coordinator restarted mid-round re-sends the round's messages under the same
            # ids, so replies sites already pushed are reused, never lost and never counted twice. The sequence
            # number keeps ids unique for ServerApps that leave group_id empty (Flower's own Strategy.start).
            key = (server_round, message.metadata.message_type, message.metadata.dst_node_id)
            message_id = f"{self._run.run_id}-{key[0]}-{key[1]}-{key[2]}-{self._sent[key]}"
            self._sent[key] += 1
            message.metadata.__dict__["_message_id"] = message_id
            self._types[message_id] = message.metadata.message_type
            self._put_on_disk_arrays(message, on_disk, put)
            envelope, chunks = split_message(message, server_round, named=named, stored=on_disk)
            fresh = ((digest, data) for digest, data in chunks.items() if digest not in put)
            self.blobs.put_stream(
                fresh, verified=True
            )  # named from these very bytes by split_message
            put.update(chunks)
            stored.append(
                (
                    message_id,
                    server_round,
                    message.metadata.dst_node_id,
                    envelope.SerializeToString(),
                )
            )
        self.blobs.sync()
        self.store.add_outbounds(self._run.run_id, stored)
        for _, _, node_id, _ in stored:
            self.service.mailbox.post(node_id)  # its site's long poll answers now
        return [message_id for message_id, *_ in stored]

    def _put_on_disk_arrays(self, message: Message, stored: Stored, put: set[str]) -> None:
        """Store the chunks of `message`'s on-disk arrays (a model kept in a file) one tensor at a time, each
        tensor's pages mapped only while it is named and written; `split_message` then finds them `stored`."""
        for record in message.content.array_records.values():
            for array in record.values():
                if not isinstance(array, OnDiskArray) or id(array) in stored:
                    continue
                pieces = byte_chunks(array.view().reshape(-1).view(np.uint8).data)
                hashes = SENT.digests(pieces)
                fresh = [
                    (d, piece) for d, piece in zip(hashes, pieces, strict=True) if d not in put
                ]
                self.blobs.put_stream(fresh, verified=True)
                put.update(hashes)
                stored[id(array)] = hashes, XXH3.digests(pieces)
                del pieces, fresh

    def pull_messages(self, message_ids: Iterable[str]) -> Iterator[Message]:
        """The stored replies to these messages not pulled before: read from the database now, each decoded
        only when the caller asks for it, so the replies are never all decoded at once."""
        wanted = [message_id for message_id in message_ids if message_id not in self._pulled]
        return self._decoded(self.store.replies_to(wanted))

    def _decoded(self, replies: list[Reply]) -> Iterator[Message]:
        for reply in replies:
            self._pulled.add(reply.reply_to_message_id)
            yield self._decode(reply)

    def _decode(self, reply: Reply) -> Message:
        metadata = Metadata(
            run_id=reply.run_id,
            message_id=f"{reply.reply_to_message_id}.reply",
            src_node_id=reply.node_id,
            dst_node_id=SUPERLINK_NODE_ID,
            reply_to_message_id=reply.reply_to_message_id,
            group_id=str(reply.server_round),
            created_at=reply.accepted_at.timestamp(),
            ttl=0.0,
            message_type=self._types[reply.reply_to_message_id],
        )
        uploads = self.blobs.uploads(reply.node_id)
        try:
            envelope = pb.Envelope.FromString(reply.envelope)
            if self.resident_bytes is not None and declared_nbytes(envelope) > self.resident_bytes:
                return stored_message(envelope, uploads, metadata)
            chunks = {digest: uploads.get(digest) for digest in chunk_hashes(envelope)}
            return join_message(envelope, chunks, metadata=metadata)
        except (EnvelopeError, KeyError, OSError, ValueError) as error:
            log.error(
                "the stored reply of node %d to %s cannot be decoded: %s",
                reply.node_id,
                metadata.reply_to_message_id,
                error,
            )
            reason = f"the coordinator could not decode this site's stored reply: {error}"
            return make_message(metadata=metadata, error=Error(ErrorCode.UNKNOWN, reason))

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterator[Message]:
        """Pushes the messages now and starts the deadline; the replies follow as sites store them."""
        pending = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        return self._receive(pending, deadline)

    def _receive(self, pending: list[str], deadline: float | None) -> Iterator[Message]:
        """Polls until every message is answered or the deadline passes. Then the unanswered messages close (their
        sites are stragglers, and late replies are refused) and what was stored before they closed still comes: time
        the caller spends on each reply counts against the deadline, and must not cost a site its on-time reply."""
        while pending and (deadline is None or time.monotonic() < deadline):
            seen = self.service.mailbox.replies
            yield from self.pull_messages(pending)
            pending = [message_id for message_id in pending if message_id not in self._pulled]
            if pending:  # woken by the next stored reply; the interval bounds a wake-up missed across processes
                wait_s = (
                    self.poll_interval_s
                    if deadline is None
                    else min(self.poll_interval_s, deadline - time.monotonic())
                )
                self.service.mailbox.wait_for_reply(seen, max(wait_s, 0.0))
        if pending:
            self.store.close_messages(pending)
            yield from self.pull_messages(pending)
