"""A Flower `Grid` over the coordinator's database and blob store, so the ServerApp and every strategy run
unchanged: pushing a message stores its envelope and chunks for the site to pull; pulling returns the
replies sites have pushed. Message ids are (run, round, type, site), so a round is never sent twice."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable

from flwr.app import Message, RecordDict
from flwr.serverapp import Grid
from flwr.supercore.run import Run

from hydrafl.identity import claim_server_identity
from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import chunk_hashes, join_message, split_message
from hydrafl.server.blobs import BlobStore
from hydrafl.server.service import CoordinatorService
from hydrafl.server.store import Store


class CoordinatorGrid(Grid):
    def __init__(
        self, store: Store, blobs: BlobStore, service: CoordinatorService, run_id: int, *, poll_interval_s: float = 0.05
    ) -> None:
        self.store = store
        self.blobs = blobs
        self.service = service
        self._run = Run.create_empty(run_id)
        self.poll_interval_s = poll_interval_s
        self._pulled: set[str] = set()
        self._sent: Counter[tuple[int, str, int]] = Counter()
        claim_server_identity(run_id)

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(
        self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str, ttl: float | None = None
    ) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self) -> Iterable[int]:
        return self.service.connected_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        message_ids = []
        for message in messages:
            server_round = int(message.metadata.group_id or 0)
            # Deterministic ids: a coordinator restarted mid-round re-sends the round's messages under the same
            # ids, so replies sites already pushed are reused, never lost and never counted twice. The sequence
            # number keeps ids unique for ServerApps that leave group_id empty (Flower's own Strategy.start).
            key = (server_round, message.metadata.message_type, message.metadata.dst_node_id)
            message_id = f"{self._run.run_id}-{key[0]}-{key[1]}-{key[2]}-{self._sent[key]}"
            self._sent[key] += 1
            message.metadata.__dict__["_message_id"] = message_id
            envelope, chunks = split_message(message, server_round)
            self.blobs.put_stream(chunks.items())
            self.store.add_outbound(
                message_id, self._run.run_id, server_round, message.metadata.dst_node_id, envelope.SerializeToString()
            )
            message_ids.append(message_id)
        return message_ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        wanted = [message_id for message_id in message_ids if message_id not in self._pulled]
        replies = []
        for reply in self.store.replies_to(wanted):
            envelope = pb.Envelope.FromString(reply.envelope)
            chunks = {digest: self.blobs.get(digest) for digest in chunk_hashes(envelope)}
            replies.append(join_message(envelope, chunks))
            self._pulled.add(reply.reply_to_message_id)
        return replies

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        pending = list(self.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while pending and (deadline is None or time.monotonic() < deadline):
            arrived = list(self.pull_messages(pending))
            replies.extend(arrived)
            answered = {reply.metadata.reply_to_message_id for reply in arrived}
            pending = [message_id for message_id in pending if message_id not in answered]
            if pending:
                time.sleep(self.poll_interval_s)
        if pending:  # the deadline passed: these sites are stragglers and their late replies will be refused
            self.store.close_messages(pending)
        return replies
