"""Content-addressed array chunks on disk: `<root>/<first two hex characters>/<digest>`.

What the coordinator sends (the global model, shared by every site) lives at the root, named by BLAKE3; what a
site uploads lives in that site's own namespace, `<root>/sites/<node id>/`, named by XXH3-128 (`envelope.naming`),
so a site can only ever read back, count against its quota, or corrupt its own uploads, and its unreferenced
uploads can be deleted without touching anyone else's. Uploads are read once, so they are stored in packs
written past the page cache (`packs.UploadPacks`); what is sent is read by every site, so it is stored here,
one file per chunk, and served from memory (`sent_cache`) or else the page cache.

A chunk is verified against its name when it is written, written to a temporary file and renamed into place, and
never rewritten, so re-sending a chunk (a resumed upload, a retry) is free and cannot corrupt what is stored.
Durability is one call per push, not one per chunk: each write only starts its writeback (sync_file_range), and
`sync` (syncfs) makes every chunk written before it durable, data and names, before the coordinator records
anything that refers to them; per-chunk fsyncs measured twice as slow here. A chunk a crash left short is
rewritten when it is sent again. Streams of chunks are verified and written by a pool of writer threads while
the next chunks arrive (digests and writes release the GIL), so an upload costs about the slowest of receiving,
checking and the disk rather than their sum.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from hydrafl.proto.chunk_wire import encode_chunk
from hydrafl.proto.envelope import SENT, UPLOADED, ChunkNaming
from hydrafl.server.disk import ChunkStat, sync_filesystem
from hydrafl.server.transport.packs import UploadPacks
from hydrafl.server.transport.sent_cache import SentCache
from hydrafl.writeback import start_writeback

WRITERS = 8
CHUNKS_IN_FLIGHT = 16
"""Per stream: at most this many received chunks wait for their writer (bounds memory per upload)."""


class BlobStore:
    def __init__(
        self,
        root: str | Path,
        *,
        naming: ChunkNaming = SENT,
        writers: ThreadPoolExecutor | None = None,
        cache: SentCache | None = None,
    ) -> None:
        """`cache`: the coordinator's chunks in their wire form, for `wire` (`sent_cache`)."""
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        self.cache = cache
        self.naming = naming
        self._writers = writers or ThreadPoolExecutor(WRITERS, thread_name_prefix="blob-writer")
        self._folders: set[str] = set()
        """Fan-out folders known to exist (saves a mkdir call per chunk)."""
        self._uploads: dict[int, UploadPacks] = {}
        self._lock = threading.Lock()

    def uploads(self, node_id: int) -> UploadPacks:
        """The namespace of one site's uploads (same writer threads)."""
        with self._lock:
            if node_id not in self._uploads:
                folder = self.root / "sites" / str(int(node_id))
                legacy = BlobStore(folder, naming=UPLOADED, writers=self._writers)
                self._uploads[node_id] = UploadPacks(folder, writers=self._writers, legacy=legacy)
            return self._uploads[node_id]

    def _file(self, digest: str) -> str:
        """Where chunk `digest` lives, as a str (pathlib costs more than the read on the download path)."""
        self.naming.check(digest)
        return os.path.join(self._root, digest[:2], digest)

    def _path(self, digest: str) -> Path:
        return Path(self._file(digest))

    def digests(self) -> list[str]:
        """Every chunk stored in this namespace (not in nested namespaces)."""
        return [path.name for path in self.root.glob("??/*") if self.naming.is_name(path.name)]

    def namespaces(self) -> list[int]:
        """The node ids of the sites that have an upload namespace here (what a sweep walks)."""
        folder = self.root / "sites"
        return (
            sorted(int(path.name) for path in folder.glob("*") if path.name.isdigit())
            if folder.is_dir()
            else []
        )

    def partials(self) -> list[Path]:
        """Temporary files of writes a crash cut short (this namespace): never a stored chunk."""
        return list(self.root.glob("??/*.part"))

    def stat(self, digest: str) -> ChunkStat:
        """Size and modification time; a sweep spares chunks written or re-put recently."""
        stat = self._path(digest).stat()
        return ChunkStat(modified=stat.st_mtime, nbytes=stat.st_size)

    def delete(self, digest: str) -> None:
        self._path(digest).unlink(missing_ok=True)
        if self.cache is not None:
            self.cache.discard(digest)

    def has(self, digest: str) -> bool:
        return self._path(digest).exists()

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The chunks not stored intact: absent, or (after a power loss) not what their name says. What a resumed
        upload must send again; reading a chunk back costs little next to sending it."""
        return [digest for digest in digests if not self._intact(digest)]

    def _intact(self, digest: str) -> bool:
        try:
            return self.naming.digest(self.get(digest)) == digest
        except KeyError:
            return False

    def put(self, digest: str, data: bytes | memoryview, *, verified: bool = False) -> bool:
        """Store a chunk; False when it was already there. A chunk that does not match its name is refused, unless
        `verified`: this process named it from these very bytes (the grid's `split_message`), so it is not hashed
        again (0.23 s of CPU per GiB of the model, every round)."""
        path = self._file(digest)
        try:
            stored_bytes = os.stat(path).st_size
        except FileNotFoundError:
            stored_bytes = None
        if stored_bytes == len(data):
            try:  # a fresh mtime: a sweep in another process that started before this put spares the chunk
                os.utime(path)
            except FileNotFoundError:  # swept just now: store it again below
                pass
            else:
                self._cache(digest, data)
                return False
        if not verified:
            self.naming.verify(digest, data)
        folder = os.path.dirname(path)
        if folder not in self._folders:
            os.makedirs(folder, exist_ok=True)
            self._folders.add(folder)
        temporary = (
            f"{path}.{threading.get_ident()}.part"  # one writer per thread and chunk at a time
        )
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(descriptor, view) :]
            start_writeback(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
        self._cache(digest, data)
        return True

    def _cache(self, digest: str, data: bytes | memoryview) -> None:
        if self.cache is not None:
            self.cache.add(digest, data)

    def sync(self) -> None:
        """Make every chunk written before this call durable, data and names: one syncfs for the filesystem."""
        sync_filesystem(self.root)

    def put_stream(
        self, chunks: Iterable[tuple[str, bytes | memoryview]], *, verified: bool = False
    ) -> tuple[int, int]:
        """Store chunks as they come, verified (see `put`) and written in parallel; returns (stored, already
        present).

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
                pending.append(self._writers.submit(self.put, digest, data, verified=verified))
                settle(CHUNKS_IN_FLIGHT)
            settle(0)
        except BaseException:
            wait(pending)
            raise
        return stored, present

    def size(self, digest: str) -> int:
        return self._path(digest).stat().st_size

    def wire(self, digest: str) -> bytes:
        """The chunk in a Chunk's wire form, as GetChunks sends it: from the cache, else read and encoded."""
        cached = self.cache.get(digest) if self.cache is not None else None
        return cached if cached is not None else encode_chunk((digest, self.get(digest)))

    def get(self, digest: str) -> bytes:
        """The chunk's bytes, read with one call (every site reads every chunk of the model)."""
        try:
            descriptor = os.open(self._file(digest), os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(f"chunk {digest[:12]} is not stored") from None
        try:
            return os.read(descriptor, os.fstat(descriptor).st_size)
        finally:
            os.close(descriptor)
