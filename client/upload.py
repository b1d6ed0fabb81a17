"""A reply's way to the coordinator: inline when small, else streamed, naming each chunk as it goes.

A large reply used to be named whole (XXH3 of every chunk), then the coordinator asked which of those names it
held, then streamed: 0.05-0.1 s per GiB before the first byte left. Now a push asks about its first chunk only.
When the coordinator lacks it, at most the few chunks in flight when an earlier stream of this reply was cut can
be there (a stream is stored in about its order; those are counted as already present, not written again), so
every chunk is sent, named on gRPC's sending thread while the network carries the previous ones, and the manifest
is built afterwards from those names. When it holds it, the push is a resume: the whole reply is named, the
coordinator says what is missing, and only that is sent, as before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from flwr.app import Message

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import UPLOADED, Named, chunk_views, split_message

Metadata = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Uploaded:
    """What one push did: chunks sent and stored, or found at the coordinator already; and its phases' seconds."""

    stored: int
    already_present: int
    resumed: bool
    duplicate: bool
    seconds: dict[str, float] = field(default_factory=dict)


def upload_reply(
    stub: CoordinatorClient,
    metadata: Metadata,
    reply: Message,
    server_round: int,
    *,
    inline_bytes: int,
) -> Uploaded:
    """Push `reply`: its chunks (inline up to `inline_bytes`, else streamed), then its envelope."""
    started = time.perf_counter()
    records = [] if reply.has_error() else reply.content.array_records.values()
    arrays = [array for record in records for array in record.values()]
    named: Named = {id(array): (array, chunk_views(array), [], []) for array in arrays}
    pieces = [piece for _, views, _, _ in named.values() for piece in views]
    if (
        not pieces or sum(len(piece) for piece in pieces) <= inline_bytes
    ):  # one call; re-putting is harmless
        envelope, chunks = split_message(reply, server_round, named=_name_all(named))
        inline = [pb.Chunk(digest=digest, data=bytes(data)) for digest, data in chunks.items()]
        pushed = stub.PushReply(
            pb.PushReplyRequest(envelope=envelope, chunks=inline), metadata=metadata
        )
        return Uploaded(
            len(inline), 0, False, pushed.duplicate, {"total": time.perf_counter() - started}
        )
    first = UPLOADED.digest(pieces[0])
    resumed = bool(stub.HasChunks(pb.HasChunksRequest(digests=[first]), metadata=metadata).present)
    asked = time.perf_counter()
    if resumed:
        envelope, chunks = split_message(reply, server_round, named=_name_all(named))
        present = set(
            stub.HasChunks(pb.HasChunksRequest(digests=list(chunks)), metadata=metadata).present
        )
        missing = [(digest, data) for digest, data in chunks.items() if digest not in present]
        put = stub.PutChunks(iter(missing), metadata=metadata) if missing else pb.PutChunksReply()
    else:
        present = set()
        put = stub.PutChunks(_named_as_sent(named), metadata=metadata)
        envelope, _ = split_message(reply, server_round, named=named)
    sent = time.perf_counter()
    pushed = stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=metadata)
    seconds = {"ask": asked - started, "put": sent - asked, "push": time.perf_counter() - sent}
    return Uploaded(
        put.stored, len(present) + put.already_present, resumed, pushed.duplicate, seconds
    )


def _name_all(named: Named) -> Named:
    for _, views, names, _ in named.values():
        names[:] = UPLOADED.digests(views)
    return named


def _named_as_sent(named: Named) -> Iterator[tuple[str, memoryview]]:
    """Every chunk once, named just before it is sent (the names land in `named` for the manifest)."""
    sent: set[str] = set()
    for _, views, names, _ in named.values():
        for view in views:
            digest = UPLOADED.digest(view)
            names.append(digest)
            if digest not in sent:
                sent.add(digest)
                yield digest, view
