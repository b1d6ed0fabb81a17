"""Content-addressed array chunks on disk: `<root>/<first two hex digits>/<sha256>`.

What the coordinator sends (the global model, shared by every site) lives at the root; what a site uploads
lives in that site's own namespace, `<root>/sites/<node id>/`, so a site can only ever read back, count against
its quota, or corrupt its own uploads, and its unreferenced uploads can be deleted without touching anyone else's.

A chunk is verified against its name when it is written, written atomically and fsynced before it counts
as stored, and never rewritten, so re-sending a chunk (a resumed upload, a retry) is free and cannot corrupt
what is stored. Streams of chunks are verified and written by a pool of writer threads while the next
chunks arrive (SHA-256, writes and fsync all release the GIL), so an upload costs about the slowest of
receiving, hashing and the disk rather than their sum.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from hydrafl.proto.envelope import EnvelopeError, is_digest, sha256

WRITERS = 8
CHUNKS_IN_FLIGHT = 16
"""Per stream: at most this many received chunks wait for their writer (bounds memory per upload)."""


class BlobStore:
    def __init__(self, root: str | Path, *, writers: ThreadPoolExecutor | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._writers = writers or ThreadPoolExecutor(WRITERS, thread_name_prefix="blob-writer")
        self._folders: set[str] = set()
        """Fan-out folders known to exist (saves a mkdir call per chunk)."""
        self._uploads: dict[int, BlobStore] = {}
        self._lock = threading.Lock()

    def uploads(self, node_id: int) -> BlobStore:
        """The namespace of one site's uploads (same writer threads)."""
        with self._lock:
            if node_id not in self._uploads:
                self._uploads[node_id] = BlobStore(self.root / "sites" / str(int(node_id)), writers=self._writers)
            return self._uploads[node_id]

    def _path(self, digest: str) -> Path:
        if not is_digest(digest):
            raise EnvelopeError(f"{digest[:80]!r} is not a SHA-256 hex digest")
        return self.root / digest[:2] / digest

    def digests(self) -> list[str]:
        """Every chunk stored in this namespace (not in nested namespaces)."""
        return [path.name for path in self.root.glob("??/*") if is_digest(path.name)]

    def namespaces(self) -> list[int]:
        """The node ids of the sites that have an upload namespace here (what a sweep walks)."""
        folder = self.root / "sites"
        return sorted(int(path.name) for path in folder.glob("*") if path.name.isdigit()) if folder.is_dir() else []

    def partials(self) -> list[Path]:
        """Temporary files of writes a crash cut short (this namespace): never a stored chunk."""
        return list(self.root.glob("??/*.part"))

    def stat(self, digest: str) -> os.stat_result:
        """Size and modification time; a sweep spares chunks written or re-put recently."""
        return self._path(digest).stat()

    def delete(self, digest: str) -> None:
        self._path(digest).unlink(missing_ok=True)

    def has(self, digest: str) -> bool:
        return self._path(digest).exists()

    def missing(self, digests: Iterable[str]) -> list[str]:
        return [digest for digest in digests if not self.has(digest)]

    def put(self, digest: str, data: bytes | memoryview) -> bool:
        """Store a chunk; False when it was already there. A chunk that does not hash to its name is refused."""
        path = str(self._path(digest))
        if os.path.exists(path):
            try:  # a fresh mtime: a sweep in another process that started before this put spares the chunk
                os.utime(path)
            except FileNotFoundError:  # swept just now: store it again below
                pass
            else:
                return False
        if sha256(data) != digest:
            raise EnvelopeError(f"chunk {digest[:12]} fails its SHA-256 check ({len(data)} bytes received)")
        folder = os.path.dirname(path)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        temporary = f"{path}.{threading.get_ident()}.part"  # one writer per thread and chunk at a time
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
        return True

    def put_stream(self, chunks: Iterable[tuple[str, bytes | memoryview]]) -> tuple[int, int]:
        """Store chunks as they come, verified and written in parallel; returns (stored, already present).

        Raises the first EnvelopeError (a bad chunk, or one `chunks` itself raises) once the writes in
        flight have finished; chunks written before it stay stored, which is harmless: each is verified."""
        pending: deque[Future[bool]] = deque()
        stored = present = 0

        def settle(keep: int) -> None:
            nonlocal stored, present
            while len(pending) > keep:
                if pending.popleft().result():
                    stored += 1
                else:
                    present += 1

        try:
            for digest, data in chunks:
                pending.append(self._writers.submit(self.put, digest, data))
                settle(CHUNKS_IN_FLIGHT)
            settle(0)
        except BaseException:
            wait(pending)
            raise
        return stored, present

    def size(self, digest: str) -> int:
        return self._path(digest).stat().st_size

    def get(self, digest: str) -> bytes:
        path = self._path(digest)
        if not path.exists():
            raise KeyError(f"chunk {digest[:12]} is not stored")
        return path.read_bytes()
