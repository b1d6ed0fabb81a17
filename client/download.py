"""A message's chunks checked, and its tensors assembled, while the rest of the message still arrives.

A site receives the coordinator's model as a stream of 1 MiB chunks. Checking a chunk (its XXH3 checksum from the
manifest, see `ChunkCheck`) and copying a tensor's chunks into its Array (the one copy Flower's serialised Array
needs) both release the GIL, so they run
on worker threads as soon as their chunks are in, overlapping the stream: a download costs about the slowest of
receiving, checking and copying rather than their sum. A chunk that fails its check refuses the message at the
next chunk received (which ends the stream) or, at the latest, when the arrays are asked for.

A tensor's chunks are let go once it is assembled, so a download holds about one model, not two (on this
machine fresh memory costs about 2 s of system time per GiB, see `malloc_tuning`). What a dropped connection
interrupts resumes from `Received`: the tensors already assembled and the checked chunks not yet used.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from flwr.app import Array

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.coordinator_pb2 import TensorManifest
from hydrafl.proto.envelope import ChunkCheck, tensor_array

WORKERS = 2
_POOL = ThreadPoolExecutor(min(WORKERS, os.cpu_count() or 1), thread_name_prefix="download")
"""One pool for the process: its threads outlive a message, so a small message pays no thread starts."""


Content = tuple[str, tuple[int, ...], tuple[str, ...]]
"""A tensor's content: dtype, shape and chunk names."""


@dataclass
class Received:
    """What the site holds of the message in hand, kept across a dropped connection: checked chunks that no
    assembled tensor has taken yet, and the tensors already assembled."""

    chunks: dict[str, bytes | memoryview] = field(default_factory=dict)
    arrays: dict[Content, Future[Array]] = field(default_factory=dict)

    def keep_for(self, envelope: pb.Envelope) -> None:
        """Keep only what this message (the same one again, after a reconnect) can use."""
        contents = {_content(tensor) for record in envelope.arrays for tensor in record.tensors}
        digests = {digest for content in contents for digest in content[2]}
        self.chunks = {digest: data for digest, data in self.chunks.items() if digest in digests}
        self.arrays = {content: array for content, array in self.arrays.items() if content in contents}

    def clear(self) -> None:
        self.chunks.clear()
        self.arrays.clear()


class Assembly:
    """The message in hand, built into `received`: `add` takes each new chunk. Use as a context manager, so its
    checks and copies end with it."""

    def __init__(self, envelope: pb.Envelope, received: Received) -> None:
        self.received = received
        self._check = ChunkCheck.of(envelope)
        self._checks: deque[tuple[str, Future[None]]] = deque()
        self._tensors = [(record.key, tensor) for record in envelope.arrays for tensor in record.tensors]
        self._assembled: dict[tuple[str, str], Future[Array]] = {}
        self._missing: dict[int, set[str]] = {}
        self._waiting: dict[str, list[int]] = {}
        """Chunk -> the tensors waiting for it to arrive."""
        self._takers: dict[str, int] = {}
        """Chunk -> how many tensors not assembled yet take it (it is let go at zero)."""
        pending = []
        for index, (key, tensor) in enumerate(self._tensors):
            assembled = received.arrays.get(_content(tensor))
            if assembled is not None:
                self._assembled[(key, tensor.name)] = assembled
                continue
            for digest in set(tensor.chunk_digests):
                self._takers[digest] = self._takers.get(digest, 0) + 1
            missing = [digest for digest in dict.fromkeys(tensor.chunk_digests) if digest not in received.chunks]
            for digest in missing:
                self._waiting.setdefault(digest, []).append(index)
            self._missing[index] = set(missing)
            pending.append(index)
        for index in pending:
            if not self._missing[index]:
                self._assemble(index)

    def __enter__(self) -> Assembly:
        return self

    def __exit__(self, *exc: object) -> None:
        """The checks finish; a chunk that failed leaves `received`, and so does every tensor built from it, so a
        resumed download fetches them again."""
        wait([check for _, check in self._checks] + list(self._assembled.values()))
        failed = {digest for digest, check in self._checks if check.exception() is not None}
        for digest in failed:
            self.received.chunks.pop(digest, None)
        for content in [content for content in self.received.arrays if failed & set(content[2])]:
            del self.received.arrays[content]

    def missing(self) -> list[str]:
        """The chunks still to come, in the manifest's order."""
        return list(self._waiting)

    def add(self, digest: str, data: bytes | memoryview) -> None:
        """One chunk received (its name and size already checked against the manifest)."""
        while self._checks and self._checks[0][1].done() and self._checks[0][1].exception() is None:
            self._checks.popleft()
        if self._checks and self._checks[0][1].done():
            self._checks[0][1].result()  # a chunk that failed its check refuses the message now
        self.received.chunks[digest] = data
        self._checks.append((digest, _POOL.submit(self._check.verify, digest, data)))
        for index in self._waiting.pop(digest, ()):
            self._missing[index].discard(digest)
            if not self._missing[index]:
                self._assemble(index)

    def arrays(self) -> dict[tuple[str, str], Array]:
        """Every tensor's Array by (record key, tensor name), once every chunk is checked; EnvelopeError names the
        first chunk that failed."""
        for _, check in self._checks:
            check.result()
        return {key: future.result() for key, future in self._assembled.items()}

    def _assemble(self, index: int) -> None:
        key, tensor = self._tensors[index]
        pieces = [self.received.chunks[digest] for digest in tensor.chunk_digests]
        assembled = _POOL.submit(tensor_array, tensor, pieces)
        self._assembled[(key, tensor.name)] = self.received.arrays[_content(tensor)] = assembled
        for digest in set(tensor.chunk_digests):
            self._takers[digest] -= 1
            if not self._takers[digest]:
                self.received.chunks.pop(digest)


def _content(tensor: TensorManifest) -> Content:
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.chunk_digests)
