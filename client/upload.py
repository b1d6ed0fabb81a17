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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from flwr.app import Array, ArrayRecord, Message

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.chunk_wire import CoordinatorClient
from hydrafl.proto.envelope import (
    UPLOADED,
    array_chunks,
    array_nbytes,
    reply_envelope,
    split_message,
)
from hydrafl.tensor_files import as_record, save_tensors

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
    """Push `reply`: its chunks (inline up to `inline_bytes`, else streamed), then its envelope. A reply of
    MappedArrays (a file-backed one, `file_backed`) streams from its file a chunk at a time."""
    started = time.perf_counter()
    arrays = list({id(array): array for array in reply_arrays(reply)}.values())
    if (
        sum(array_nbytes(array) for array in arrays) <= inline_bytes
    ):  # one call; re-putting is harmless
        envelope, chunks = split_message(reply, server_round)
        inline = [pb.Chunk(digest=digest, data=bytes(data)) for digest, data in chunks.items()]
        pushed = stub.PushReply(
            pb.PushReplyRequest(envelope=envelope, chunks=inline), metadata=metadata
        )
        return Uploaded(
            len(inline), 0, False, pushed.duplicate, {"total": time.perf_counter() - started}
        )
    pieces = {id(array): array_chunks(array) for array in arrays}
    first = UPLOADED.digest(next(chunks[0] for chunks in pieces.values() if len(chunks)))
    resumed = bool(stub.HasChunks(pb.HasChunksRequest(digests=[first]), metadata=metadata).present)
    asked = time.perf_counter()
    names: dict[int, list[str]] = {}
    if resumed:
        names = {
            key: [UPLOADED.digest(chunk) for chunk in chunks] for key, chunks in pieces.items()
        }
        listed = list(dict.fromkeys(name for chunk_names in names.values() for name in chunk_names))
        present = set(
            stub.HasChunks(pb.HasChunksRequest(digests=listed), metadata=metadata).present
        )
        missing = set(listed) - present
        put = (
            stub.PutChunks(_missing(pieces, names, missing), metadata=metadata)
            if missing
            else pb.PutChunksReply()
        )
    else:
        present = set()
        put = stub.PutChunks(_named_as_sent(pieces, names), metadata=metadata)
    envelope = reply_envelope(reply, server_round, names)
    sent = time.perf_counter()
    pushed = stub.PushReply(pb.PushReplyRequest(envelope=envelope), metadata=metadata)
    seconds = {"ask": asked - started, "put": sent - asked, "push": time.perf_counter() - sent}
    return Uploaded(
        put.stored, len(present) + put.already_present, resumed, pushed.duplicate, seconds
    )


def file_backed(reply: Message, path: Path) -> None:
    """Write the reply's arrays to the safetensors file `path` (a tensor at a time) and put MappedArrays over it
    in their place, so the arrays in memory can go before the upload and it streams from the file."""
    records = reply.content.array_records
    tensors = {
        f"{index}:{name}": array
        for index, record in enumerate(records.values())
        for name, array in record.items()
    }
    mapped = save_tensors(path, tensors, durable=False)  # read back by this process, then removed
    for index, (key, record) in enumerate(list(records.items())):
        reply.content[key] = as_record({name: mapped[f"{index}:{name}"] for name in record})


def _missing(
    pieces: dict[int, Sequence[bytes | memoryview]], names: dict[int, list[str]], missing: set[str]
) -> Iterator[tuple[str, bytes | memoryview]]:
    """The chunks the coordinator lacks, each once; a file's chunks are read only if they are sent."""
    for key, chunks in pieces.items():
        for index, digest in enumerate(names[key]):
            if digest in missing:
                missing.discard(digest)
                yield digest, chunks[index]


def _named_as_sent(
    pieces: dict[int, Sequence[bytes | memoryview]], names: dict[int, list[str]]
) -> Iterator[tuple[str, bytes | memoryview]]:
    """Every chunk once, named just before it is sent (the names land in `names` for the manifest)."""
    sent: set[str] = set()
    for key, chunks in pieces.items():
        names[key] = []
        for chunk in chunks:
            digest = UPLOADED.digest(chunk)
            names[key].append(digest)
            if digest not in sent:
                sent.add(digest)
                yield digest, chunk


def reply_arrays(reply: Message) -> list[Array]:
    """Every Array of `reply`'s array records, in order (an array two records share, twice); none for an error."""
    records = [] if reply.has_error() else reply.content.array_records.values()
    return [array for record in records for array in record.values()]


def let_go(reply: Message) -> None:
    """Empty a sent reply and its array records. Flower's RecordDict and records refer to themselves (their item
    dicts call back into them), so a sent reply would wait for the cycle collector, which may not run for
    minutes, with its arrays: a model's worth of memory, or a reply file (`removed_when_unused`) on disk."""
    if reply.has_error():
        return
    for record in reply.content.values():
        if isinstance(record, ArrayRecord):
            record.clear()
    reply.content.clear()
