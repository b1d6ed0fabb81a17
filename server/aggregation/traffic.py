"""The bytes of a round, per direction and per site: what `rounds.tsv` and the dashboard report. Only array
payloads count (what grows with the model), before transport framing."""

from __future__ import annotations

from collections.abc import Sequence

from flwr.app import ArrayRecord, Message

from hydrafl.arrays import record_nbytes
from hydrafl.rounds import RoundRecord
from hydrafl.updates import records


def array_bytes(message: Message) -> int:
    """The array payload bytes `message` carries."""
    return sum(record_nbytes(r) for r in records(message.content, ArrayRecord))


def count_down(messages: Sequence[Message], record: RoundRecord) -> None:
    """Count what `messages` carry to their sites."""
    for message in messages:
        nbytes = array_bytes(message)
        node = str(message.metadata.dst_node_id)
        record.bytes_down += nbytes
        record.bytes_down_per_site[node] = record.bytes_down_per_site.get(node, 0) + nbytes


def count_up(reply: Message, record: RoundRecord, nbytes: int | None = None) -> None:
    """Count a reply's array bytes, or `nbytes` (what it carried on the wire, when it was compressed)."""
    nbytes = array_bytes(reply) if nbytes is None else nbytes
    node = str(reply.metadata.src_node_id)
    record.bytes_up += nbytes
    record.bytes_up_per_site[node] = record.bytes_up_per_site.get(node, 0) + nbytes
