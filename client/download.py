"""A message's chunks checked, and its tensors assembled, while the rest of the message still arrives.

A site receives the coordinator's model as a stream of 1 MiB chunks. Checking a chunk's BLAKE3 and copying a
tensor's chunks into its Array (the one copy Flower's serialised Array needs) both release the GIL, so they run
on worker threads as soon as their chunks are in, overlapping the stream: a download costs about the slowest of
receiving, checking and copying rather than their sum. A chunk that fails its check refuses the message at the
next chunk received (which ends the stream) or, at the latest, when the arrays are asked for.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait

from flwr.app import Array

from hydrafl.proto import coordinator_pb2 as pb
from hydrafl.proto.envelope import SENT, EnvelopeError, tensor_array

WORKERS = 2
_POOL = ThreadPoolExecutor(min(WORKERS, os.cpu_count() or 1), thread_name_prefix="download")
"""One pool for the process: its threads outlive a message, so a small message pays no thread starts."""


class Assembly:
    """The message in hand: `chunks` (the site's chunk cache) are the chunks received so far, already checked;
    `add` takes each new one. Use as a context manager, so its checks and copies end with it."""

    def __init__(self, envelope: pb.Envelope, chunks: dict[str, bytes | memoryview]) -> None:
        self.chunks = chunks
        self._checks: deque[tuple[str, Future[None]]] = deque()
        self._tensors = [(record.key, tensor) for record in envelope.arrays for tensor in record.tensors]
        self._assembled: dict[tuple[str, str], Future[Array]] = {}
        self._missing: dict[int, set[str]] = {}
        self._users: dict[str, list[int]] = {}
        for index, (_, tensor) in enumerate(self._tensors):
            missing = {digest for digest in tensor.chunk_digests if digest not in chunks}
            for digest in missing:
                self._users.setdefault(digest, []).append(index)
            self._missing[index] = missing
            if not missing:
                self._assemble(index)

    def __enter__(self) -> Assembly:
        return self

    def __exit__(self, *exc: object) -> None:
        """The checks finish; a chunk that failed leaves the cache, so a resumed download fetches it again."""
        wait([check for _, check in self._checks] + list(self._assembled.values()))
        for digest, check in self._checks:
            if check.exception() is not None:
                self.chunks.pop(digest, None)

    def add(self, digest: str, data: bytes | memoryview) -> None:
        """One chunk received (its name and size already checked against the manifest)."""
        while self._checks and self._checks[0][1].done() and self._checks[0][1].exception() is None:
            self._checks.popleft()
        if self._checks and self._checks[0][1].done():
            self._checks[0][1].result()  # a chunk that failed its check refuses the message now
        self.chunks[digest] = data
        self._checks.append((digest, _POOL.submit(_check, digest, data)))
        for index in self._users.pop(digest, ()):
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
        pieces = [self.chunks[digest] for digest in tensor.chunk_digests]
        self._assembled[(key, tensor.name)] = _POOL.submit(tensor_array, tensor, pieces)


def _check(digest: str, data: bytes | memoryview) -> None:
    if SENT.digest(data) != digest:
        raise EnvelopeError(f"chunk {digest[:12]} from the coordinator fails its {SENT.algorithm} check")
