"""What each site may download and upload right now: the chunks of the messages it may still answer, what a
reply to them may upload (`limits.UploadQuota`), and its uploads that no accepted reply references yet
(`limits.UploadLedger`), deleted when a push fails or the site has nothing left to answer."""

from __future__ import annotations

import threading
from collections import OrderedDict

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import chunk_hashes
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.transport import limits as bounds
from hydrafl.server.transport.replies import allowed_reply_bytes, allowed_reply_chunks

REMEMBERED_MESSAGES = 4096
"""How many recent messages' chunks and quotas are kept in memory (others are read again when asked)."""


class SiteUploads:
    def __init__(self, store: Store, blobs: BlobStore, max_model_bytes: int) -> None:
        self.store = store
        self.blobs = blobs
        self.max_model_bytes = max_model_bytes
        self.ledger = bounds.UploadLedger()
        self._lock = threading.Lock()
        self._message_chunks: OrderedDict[str, tuple[frozenset[str], bounds.UploadQuota]] = (
            OrderedDict()
        )
        """Outbound message id -> (its chunks, what a reply may upload), for the recent messages."""
        self._locks: dict[int, threading.RLock] = {}
        """Per site: held by a push from its check until its chunks are referenced, and by freeing the site's
        pending uploads, so that a concurrent failure of the same site never deletes what a push accepts."""

    def open_messages(self, node_id: int) -> list[tuple[frozenset[str], bounds.UploadQuota]]:
        """(chunks, what a reply may upload) of each message this site may still answer."""
        described = []
        for message in self.store.open_messages_for(node_id):
            with self._lock:
                known = self._message_chunks.get(message.message_id)
            if known is None:
                sent = pb.Envelope.FromString(message.envelope)
                allowed = bounds.UploadQuota(
                    allowed_reply_bytes(sent, self.max_model_bytes),
                    allowed_reply_chunks(sent, self.max_model_bytes),
                )
                known = frozenset(chunk_hashes(sent)), allowed
                with self._lock:
                    self._message_chunks[message.message_id] = known
                    while len(self._message_chunks) > REMEMBERED_MESSAGES:
                        self._message_chunks.popitem(last=False)
            described.append(known)
        return described

    def downloadable(self, node_id: int) -> frozenset[str]:
        return frozenset().union(*(chunks for chunks, _ in self.open_messages(node_id)))

    def quota(self, node_id: int) -> bounds.UploadQuota:
        allowed = [quota for _, quota in self.open_messages(node_id)]
        return bounds.UploadQuota(
            sum(quota.nbytes for quota in allowed), sum(quota.chunks for quota in allowed)
        )

    def free(self, node_id: int) -> None:
        """Delete the site's uploads that no accepted reply references (a failed or expired push)."""
        uploads = self.blobs.uploads(node_id)
        with self.lock(node_id):
            for digest in self.ledger.release(node_id):
                uploads.delete(digest)

    def lock(self, node_id: int) -> threading.RLock:
        with self._lock:
            return self._locks.setdefault(node_id, threading.RLock())
