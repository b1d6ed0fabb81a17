"""A site's uploads on disk: one pack file per upload stream, written past the page cache.

An upload is read once (checked, aggregated) and then deleted, so it gains nothing from the page cache, and
filling the cache is what storing an upload cost most here: measured on this machine, 1 GiB written as 1024
chunk files took 3 s of system time (new page-cache pages; each file created, allocated and renamed), where
the same bytes as the slots of one preallocated file written with O_DIRECT took 0.06 s, at the disk's speed.
So each stream of chunks (a PutChunks call, or the chunks inline in a PushReply) fills one pack:

    <namespace>/packs/<id>.pack.part   while its stream runs (a crash leaves it: a partial, swept later)
    <namespace>/packs/<id>.pack        once its stream has ended, however it ended; never appended to again

A pack is a row of fixed-size slots, slot i at i * SLOT_BYTES: a 4 KiB header (magic, data length, write
time, the chunk's XXH3-128 name), then up to one chunk of data, written together in one aligned write from a
per-thread buffer. The headers on disk are the truth. The index in memory (name -> pack and slot) is built
from them and checked against the slot's header at every use, so what another process did is seen: a sweep
that erased a slot, a pack another process finished. Deleting a chunk erases its slot (punches a hole, or at
least zeroes its header); a finished pack with no chunk left is unlinked. Durability is as before: `sync`
(one syncfs) before the coordinator records a reply that refers to these chunks. Where O_DIRECT is not
supported (tmpfs, other systems) the same writes go through the page cache.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hydrafl.proto.envelope import CHUNK_BYTES, UPLOADED, EnvelopeError
from hydrafl.server.disk import ChunkStat, open_file, opened, preallocate, sync_filesystem
from hydrafl.server.transport.pack_slots import (
    HEADER_BYTES,
    HEADER_FORMAT,
    SLOT_BYTES,
    Header,
    blocks,
    erase,
    headers,
    pack_header,
    parse_header,
    slot_buffer,
    write_header,
)

if TYPE_CHECKING:
    from hydrafl.server.blobs import BlobStore

PREALLOCATE_SLOTS = 64
"""A stream's pack grows by at most this many slots at a time; what the stream did not use is cut off at its end."""
CHUNKS_IN_FLIGHT = 16
"""Per stream: at most this many received chunks wait for their writer (bounds memory per upload)."""
TRUSTED_S = 60.0
"""A slot this process wrote or read within this long is taken from the index without reading its header again:
a sweep beside a live coordinator spares chunks written in the last `retention.ORPHAN_GRACE_S` (an hour), so
nothing erases it meanwhile."""
SCAN_SETTLE_NS = 100_000_000
"""A folder modified this recently may change again within its timestamp's granularity: look again next time."""
_SEALED, _PARTIAL = ".pack", ".pack.part"


@dataclass(slots=True)
class _PackRef:
    """Where a pack is now (a stream's pack is renamed when the stream ends) and how many indexed chunks it holds."""

    path: Path
    indexed: int = 0


@dataclass(frozen=True, slots=True)
class _Slot:
    pack: _PackRef
    index: int
    header: Header
    """As this process last wrote or read it."""


class UploadPacks:
    """One site's upload namespace, with the interface of `BlobStore` (chunks named by `UPLOADED`). Chunk files
    an earlier version stored there (`legacy`) are still read, re-put and deleted; new chunks go into packs."""

    naming = UPLOADED

    def __init__(self, root: str | Path, *, writers: ThreadPoolExecutor, legacy: BlobStore) -> None:
        self.root = Path(root)
        self.packs = self.root / "packs"
        self._writers = writers
        self._legacy = legacy if any(self.root.glob("??")) else None
        """The earlier version's chunk files, where there are any (none are ever added)."""
        self._lock = threading.Lock()
        self._written = threading.Condition(self._lock)
        """Notified whenever a chunk's write ends (see `_writing`)."""
        self._writing: set[str] = set()
        """Chunks being written now. A name arriving again meanwhile (in the same stream or another of this site)
        counts as present, so a name never has two slots; deleting one waits for its write to end."""
        self._index: dict[str, _Slot] = {}
        self._scanned: set[Path] = set()
        self._scanned_at_ns = -1
        """The packs folder's modification time at the last full look (-1: look again)."""
        self._finite32: set[str] = set()
        """Chunks this process wrote whose bytes, read as float32, are all finite."""

    # --- reading ----------------------------------------------------------------------------------------------

    def has(self, digest: str) -> bool:
        return self._find(digest) is not None or (
            self._legacy is not None and self._legacy.has(digest)
        )

    def get(self, digest: str) -> bytes:
        found = self._find(digest)
        if found is None:
            return self._legacy_store(digest).get(digest)
        slot, header = found
        with opened(slot.pack.path, os.O_RDONLY) as descriptor:
            data = os.pread(descriptor, header.nbytes, slot.index * SLOT_BYTES + HEADER_BYTES)
        if len(data) != header.nbytes:
            raise KeyError(f"chunk {digest[:12]} is cut short on disk")
        return data

    def read_into(self, digest: str, out: np.ndarray) -> None:
        """The chunk's bytes into `out` (uint8, exactly its size), with no buffer of its own, and past the page
        cache where `out` is aligned for it: a stored reply is read once, so caching it would only evict pages
        worth keeping, and a fresh buffer per chunk faults its pages in one by one."""
        found = self._find(digest)
        if found is None:
            out[:] = np.frombuffer(self._legacy_store(digest).get(digest), np.uint8)
            return
        slot, header = found
        if out.nbytes != header.nbytes:
            raise EnvelopeError(
                f"chunk {digest[:12]} holds {header.nbytes} bytes, not {out.nbytes}"
            )
        aligned = out.nbytes % HEADER_BYTES == 0 and out.ctypes.data % HEADER_BYTES == 0
        with opened(slot.pack.path, os.O_RDONLY, direct=aligned) as descriptor:
            done = os.preadv(descriptor, [out.data], slot.index * SLOT_BYTES + HEADER_BYTES)
        if done != header.nbytes:
            raise KeyError(f"chunk {digest[:12]} is cut short on disk")

    def size(self, digest: str) -> int:
        found = self._find(digest)
        return self._legacy_store(digest).size(digest) if found is None else found[1].nbytes

    def stat(self, digest: str) -> ChunkStat:
        found = self._find(digest)
        if found is None:
            return self._legacy_store(digest).stat(digest)
        return ChunkStat(modified=found[1].modified, nbytes=found[1].nbytes)

    def missing(self, digests: Iterable[str]) -> list[str]:
        """The chunks not stored intact: absent, or (after a power loss) not what their name says. What a resumed
        upload must send again; reading a chunk back costs little next to sending it."""
        return [digest for digest in digests if not self._intact(digest)]

    def digests(self) -> list[str]:
        """Every chunk stored in the finished packs of this namespace."""
        self._scan(force=True)
        with self._lock:
            known = list(self._index)
        legacy = self._legacy.digests() if self._legacy is not None else []
        return [digest for digest in known if self._find(digest) is not None] + legacy

    def partials(self) -> list[Path]:
        """Packs of streams that never ended (a crash): never indexed; a sweep deletes them after its grace."""
        packs = sorted(self.packs.glob(f"*{_PARTIAL}")) if self.packs.is_dir() else []
        return packs + (self._legacy.partials() if self._legacy is not None else [])

    def finite_float32(self, digest: str) -> bool:
        """True when this process wrote the chunk and its bytes, read as float32, are all finite; False says
        nothing (read it to know)."""
        with self._lock:
            return digest in self._finite32

    # --- writing ----------------------------------------------------------------------------------------------

    def put(self, digest: str, data: bytes | memoryview) -> bool:
        """Store one chunk (in a pack of its own); False when it was already there."""
        stored, _ = self.put_stream([(digest, data)])
        return bool(stored)

    def put_stream(self, chunks: Iterable[tuple[str, bytes | memoryview]]) -> tuple[int, int]:
        """Store chunks as they come, verified and written in parallel into one new pack; (stored, already
        present). Raises the first EnvelopeError (a bad chunk, or one `chunks` itself raises) once the writes in
        flight have finished; chunks written before it stay stored, which is harmless: each was verified."""
        pending: deque[Future[None]] = deque()
        present = 0
        pack = _StreamPack(self.packs)
        try:
            for digest, data in chunks:
                self.naming.check(digest)
                if (
                    self._refresh(digest)
                    or self._legacy_present(digest, data)
                    or not self._claim(digest)
                ):
                    present += 1
                    continue
                pending.append(
                    self._writers.submit(self._write, pack, pack.next_slot(), digest, data)
                )
                while len(pending) > CHUNKS_IN_FLIGHT:
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
        except BaseException:
            wait(pending)
            raise
        finally:
            pack.seal()
        return pack.written, present

    def _claim(self, digest: str) -> bool:
        """Take the chunk to write it; False when it is being written, or was stored since the caller looked."""
        with self._lock:
            if digest in self._writing or digest in self._index:
                return False
            self._writing.add(digest)
            return True

    def _write(self, pack: _StreamPack, index: int, digest: str, data: bytes | memoryview) -> None:
        try:
            self._write_claimed(pack, index, digest, data)
        finally:
            with self._written:
                self._writing.discard(digest)
                self._written.notify_all()

    def _write_claimed(
        self, pack: _StreamPack, index: int, digest: str, data: bytes | memoryview
    ) -> None:
        if len(data) > CHUNK_BYTES:
            raise EnvelopeError(f"chunk {digest[:12]} has {len(data)} bytes; at most {CHUNK_BYTES}")
        self.naming.verify(digest, data)
        buffer = slot_buffer()
        np.frombuffer(buffer, np.uint8, len(data), HEADER_BYTES)[:] = np.frombuffer(
            data, np.uint8
        )  # GIL released
        header = Header(len(data), time.time(), digest)
        buffer[: HEADER_FORMAT.size] = pack_header(header)
        pack.write(memoryview(buffer)[: HEADER_BYTES + blocks(len(data))], index)
        # checked in the aligned copy: the received bytes sit at an odd offset, where numpy would copy them again
        values = np.frombuffer(buffer, np.float32, len(data) // 4, HEADER_BYTES)
        finite = len(data) % 4 == 0 and bool(np.isfinite(values).all())
        with self._lock:
            self._add(digest, _Slot(pack.ref, index, header))
            if finite:
                self._finite32.add(digest)

    def _refresh(self, digest: str) -> bool:
        """A chunk stored already gets a fresh write time (so that a sweep in another process, started before this
        put, spares it) and is not written again; False when it is not stored."""
        found = self._find(digest)
        if found is None:
            return False
        slot, header = found
        refreshed = Header(header.nbytes, time.time(), digest)
        try:
            with opened(slot.pack.path, os.O_WRONLY, direct=True) as descriptor:
                write_header(descriptor, slot.index, refreshed)
        except FileNotFoundError:  # its pack went just now: store it again
            return False
        with self._lock:
            self._add(digest, _Slot(slot.pack, slot.index, refreshed))
        return True

    def _legacy_store(self, digest: str) -> BlobStore:
        """Where to look for a chunk the packs do not hold: KeyError when there is nowhere else."""
        if self._legacy is None:
            raise KeyError(f"chunk {digest[:12]} is not stored")
        return self._legacy

    def _legacy_present(self, digest: str, data: bytes | memoryview) -> bool:
        """Whether an earlier version's chunk file holds this chunk (its mtime refreshed by the re-put)."""
        return (
            self._legacy is not None
            and self._legacy.has(digest)
            and not self._legacy.put(digest, data)
        )

    def delete(self, digest: str) -> None:
        """Erase the chunk's slot (once a write of it in flight has ended); a finished pack goes with its last
        chunk."""
        with self._written:
            self._written.wait_for(lambda: digest not in self._writing)
        found = self._find(digest)
        if found is None:
            with self._lock:
                self._finite32.discard(digest)
            if self._legacy is not None:
                self._legacy.delete(digest)
            return
        slot = found[0]
        with self._lock:
            self._remove(digest, slot)
            self._finite32.discard(digest)
        path = slot.pack.path
        try:
            with opened(path, os.O_WRONLY, direct=True) as descriptor:
                erase(descriptor, slot.index)
        except FileNotFoundError:
            return
        if slot.pack.indexed == 0 and path.name.endswith(_SEALED) and not any(headers(path)):
            path.unlink(missing_ok=True)

    def sync(self) -> None:
        """Make every chunk written before this call durable, data and names: one syncfs for the filesystem."""
        sync_filesystem(self.root)

    # --- the index ----------------------------------------------------------------------------------------------

    def _add(self, digest: str, slot: _Slot) -> None:
        previous = self._index.get(digest)
        if previous is not None:
            previous.pack.indexed -= 1
        self._index[digest] = slot
        slot.pack.indexed += 1

    def _remove(self, digest: str, slot: _Slot) -> None:
        if self._index.get(digest) == slot:
            del self._index[digest]
            slot.pack.indexed -= 1

    def _intact(self, digest: str) -> bool:
        try:
            return self.naming.digest(self.get(digest)) == digest
        except KeyError:
            return False

    def _find(self, digest: str) -> tuple[_Slot, Header] | None:
        """The chunk's slot and header, checked on disk unless this process saw it lately (TRUSTED_S); when the
        name is not known, the finished packs that appeared since the last look (this process's or another's)
        are read first."""
        self.naming.check(digest)
        for attempt in range(2):
            with self._lock:
                slot = self._index.get(digest)
            if slot is not None:
                if time.time() - slot.header.modified < TRUSTED_S:
                    return slot, slot.header
                header = _read_header(slot)
                if header is not None and header.digest == digest:
                    return slot, header
                with self._lock:
                    self._remove(digest, slot)
            if attempt == 0 and not self._scan():
                return None
        return None

    def _scan(self, *, force: bool = False) -> bool:
        """Index the finished packs not indexed yet (skipped while the folder is unchanged); whether any were."""
        try:
            modified_ns = self.packs.stat().st_mtime_ns
        except FileNotFoundError:
            return False
        with self._lock:
            if modified_ns == self._scanned_at_ns and not force:
                return False
            self._scanned_at_ns = (
                modified_ns if time.time_ns() - modified_ns > SCAN_SETTLE_NS else -1
            )
            new = [path for path in self.packs.glob(f"*{_SEALED}") if path not in self._scanned]
            self._scanned.update(new)
        for path in new:
            ref = _PackRef(path)
            slots = [
                (index, header) for index, header in enumerate(headers(path)) if header is not None
            ]
            with self._lock:
                for index, header in slots:
                    if header.digest not in self._index:
                        self._add(header.digest, _Slot(ref, index, header))
        return bool(new)


class _StreamPack:
    """The pack one stream fills: created at its first chunk, slots handed out in order, finished at its end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        name = f"{time.time_ns():x}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.ref = _PackRef(folder / f"{name}{_PARTIAL}")
        self.final_path = folder / f"{name}{_SEALED}"
        self.written = 0
        self._descriptor: int | None = None
        self._slots = 0
        self._allocated = 0
        self._lock = threading.Lock()

    def next_slot(self) -> int:
        with self._lock:
            if self._descriptor is None:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._descriptor = open_file(
                    self.ref.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, direct=True
                )
            index, self._slots = self._slots, self._slots + 1
            if (
                self._slots > self._allocated
            ):  # 1, 2, 4, ... slots ahead: a one-chunk reply allocates one
                more = min(max(self._allocated, 1), PREALLOCATE_SLOTS)
                preallocate(self._descriptor, self._allocated * SLOT_BYTES, more * SLOT_BYTES)
                self._allocated += more
            return index

    def write(self, data: memoryview, index: int) -> None:
        assert self._descriptor is not None  # opened by the slot's allocation
        written = os.pwrite(self._descriptor, data, index * SLOT_BYTES)
        if written != len(data):
            raise OSError(f"short write to {self.ref.path.name}: {written} of {len(data)} bytes")
        with self._lock:
            self.written += 1

    def seal(self) -> None:
        """End the stream: the unused tail cut off, then the pack under its final name (linked before the partial
        name goes, so a reader always finds it), or removed when it holds no chunk."""
        if self._descriptor is None:
            return
        try:
            os.ftruncate(self._descriptor, self._slots * SLOT_BYTES)
        finally:
            os.close(self._descriptor)
        partial = self.ref.path
        if (
            not self.written or not self.ref.indexed
        ):  # none written, or all deleted while the stream ran
            partial.unlink(missing_ok=True)
            return
        try:
            os.link(partial, self.final_path)
        except OSError:  # a file system without hard links: renamed, unseen for an instant
            os.replace(partial, self.final_path)
        self.ref.path = self.final_path
        partial.unlink(missing_ok=True)


def _read_header(slot: _Slot) -> Header | None:
    """The slot's header; a stream's pack renamed while this looked is looked for again under its new name."""
    for _ in range(2):
        path = slot.pack.path
        try:
            with opened(path, os.O_RDONLY) as descriptor:
                return parse_header(
                    os.pread(descriptor, HEADER_FORMAT.size, slot.index * SLOT_BYTES)
                )
        except FileNotFoundError:
            if slot.pack.path == path:
                return None
    return None
