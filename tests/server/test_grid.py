"""The coordinator's grid streams a round's replies: each decoded from the blob store when the caller asks for it and
not kept afterwards; at the deadline the unanswered messages close, and what was stored before still comes."""

from __future__ import annotations

import time
import weakref

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict

from hydrafl.proto.envelope import split_message
from hydrafl.server.blobs import BlobStore
from hydrafl.server.store import Store
from hydrafl.server.tables import Reply
from hydrafl.server.transport.grid import CoordinatorGrid
from hydrafl.server.transport.service import CoordinatorService


class _CountingGrid(CoordinatorGrid):
    """The coordinator's grid, counting the stored replies it has decoded."""

    decoded = 0

    def _decode(self, reply: Reply) -> Message:
        self.decoded += 1
        return super()._decode(reply)


@pytest.fixture
def round_of_three(tmp_path) -> tuple[_CountingGrid, list[Message]]:
    """A running run's grid (no gRPC service: sites' replies are stored directly) and its three train messages."""
    store = Store(f"sqlite:///{tmp_path / 'coordinator.db'}")
    nodes = [store.add_site(f"site-{i}")[0].node_id for i in range(3)]
    run = store.create_run({"rounds": 1})
    store.set_run_status(run.id, "running")
    blobs = BlobStore(tmp_path / "blobs")
    grid = _CountingGrid(
        store, blobs, CoordinatorService(store, blobs), run.id, poll_interval_s=0.01
    )
    arrays = ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32))})
    messages = [
        Message(RecordDict({"arrays": arrays}), dst_node_id=node, message_type="train")
        for node in nodes
    ]
    for message in messages:
        message.metadata.group_id = "1"
    return grid, messages


def _store_reply(grid: CoordinatorGrid, message: Message, value: float) -> None:
    """What the service does with a site's accepted reply: its chunks in the site's uploads, its envelope a row."""
    content = RecordDict(
        {
            "arrays": ArrayRecord({"w": Array(np.full(4, value, dtype=np.float32))}),
            "metrics": MetricRecord({"num-examples": 1}),
        }
    )
    reply = Message(content, reply_to=message)
    reply.metadata.__dict__["_message_id"] = f"{message.metadata.message_id}.reply"
    envelope, chunks = split_message(reply, 1)
    grid.blobs.uploads(message.metadata.dst_node_id).put_stream(chunks.items())
    grid.store.add_reply(
        grid.store.outbound(message.metadata.message_id), envelope.SerializeToString()
    )


def test_each_reply_is_decoded_when_asked_for_and_not_kept(round_of_three):
    grid, messages = round_of_three
    replies = grid.send_and_receive(messages, timeout=30)
    for value, message in enumerate(messages):
        _store_reply(grid, message, value)
    first = next(replies)
    assert grid.decoded == 1
    arrays = weakref.ref(first.content["arrays"])
    del first
    assert arrays() is None  # the grid holds no reply it has yielded
    values = [float(reply.content["arrays"]["w"].numpy()[0]) for reply in replies]
    assert grid.decoded == 3 and sorted(values) == [1.0, 2.0]


def test_at_the_deadline_unanswered_messages_close_and_replies_stored_before_still_come(
    round_of_three,
):
    grid, messages = round_of_three
    replies = grid.send_and_receive(messages, timeout=0.5)
    _store_reply(grid, messages[0], 0)
    assert next(replies).metadata.src_node_id == messages[0].metadata.dst_node_id
    _store_reply(
        grid, messages[1], 1
    )  # on time, while the caller still works on the first reply, past the deadline
    time.sleep(0.6)
    assert [reply.metadata.src_node_id for reply in replies] == [messages[1].metadata.dst_node_id]
    assert grid.store.outbound(
        messages[2].metadata.message_id
    ).closed  # the straggler's late reply will be refused
