"""Where compressed replies enter the server side: decoded once, before any check or strategy sees them, so
every strategy (Flower's built-ins included) aggregates plain float32 deltas and stays unchanged."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Message

from hydrafl.arrays import array_view, to_record
from hydrafl.compression.codecs import decode
from hydrafl.compression.layout import RECORD, CompressionError, Scheme, read_description


def is_compressed(reply: Message) -> bool:
    return not reply.has_error() and isinstance(reply.content.get(RECORD), ConfigRecord)


def decode_reply(reply: Message, scheme: Scheme) -> Message:
    """`reply` with its compressed ArrayRecord replaced by the decoded deltas (in place). A plain reply passes as
    it is; a compressed one must be in the run's scheme (`scheme`, the receiver's, never the reply's) and match
    its layout exactly, else CompressionError."""
    if not is_compressed(reply):
        return reply
    if not scheme.enabled:
        raise CompressionError("the reply is compressed; this run sends updates uncompressed")
    keys = [key for key, record in reply.content.items() if isinstance(record, ArrayRecord)]
    if len(keys) != 1:
        raise CompressionError(f"a compressed reply holds one ArrayRecord, not {len(keys)}")
    shapes = read_description(scheme, dict(reply.content[RECORD]))
    arrays = {
        name: array_view(array) for name, array in reply.content.array_records[keys[0]].items()
    }
    reply.content[keys[0]] = to_record(decode(arrays, shapes, scheme))
    del reply.content[RECORD]
    return reply
