"""The slots of an upload pack (`packs`): slot i at i * SLOT_BYTES, a 4 KiB header (magic, data length, write
time, the chunk's XXH3-128 name) and then up to one chunk of data, written from a per-thread aligned buffer."""

from __future__ import annotations

import mmap
import os
import struct
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hydrafl.proto.envelope import CHUNK_BYTES, UPLOADED
from hydrafl.server.disk import opened, punch_hole

HEADER_BYTES = 4096
"""One O_DIRECT block, so that the data after it stays aligned."""
SLOT_BYTES = HEADER_BYTES + CHUNK_BYTES
_MAGIC = b"HYDRAPK1"
HEADER_FORMAT = struct.Struct("<8sQd32s")  # magic, data length, write time (Unix seconds), name
_BUFFERS = threading.local()


@dataclass(frozen=True, slots=True)
class Header:
    nbytes: int
    modified: float
    digest: str


def pack_header(header: Header) -> bytes:
    return HEADER_FORMAT.pack(_MAGIC, header.nbytes, header.modified, header.digest.encode())


def parse_header(raw: bytes) -> Header | None:
    if len(raw) < HEADER_FORMAT.size:
        return None
    magic, nbytes, modified, name = HEADER_FORMAT.unpack_from(raw)
    digest = name.decode("ascii", errors="replace")
    if magic != _MAGIC or nbytes > CHUNK_BYTES or not UPLOADED.is_name(digest):
        return None
    return Header(nbytes, modified, digest)


def headers(path: Path) -> Iterator[Header | None]:
    """Each slot's header (None for an erased or never written slot), in slot order."""
    try:
        with opened(path, os.O_RDONLY) as descriptor:
            for index in range(os.fstat(descriptor).st_size // SLOT_BYTES):
                yield parse_header(os.pread(descriptor, HEADER_FORMAT.size, index * SLOT_BYTES))
    except FileNotFoundError:
        return


def blocks(nbytes: int) -> int:
    """`nbytes` rounded up to whole O_DIRECT blocks."""
    return -(-nbytes // HEADER_BYTES) * HEADER_BYTES


def slot_buffer() -> mmap.mmap:
    """This thread's slot-sized buffer: page-aligned, as O_DIRECT needs, and reused, so it stays in memory."""
    buffer = getattr(_BUFFERS, "slot", None)
    if buffer is None:
        buffer = _BUFFERS.slot = mmap.mmap(-1, SLOT_BYTES)
    return buffer


def erase(descriptor: int, index: int) -> None:
    """Free the slot's blocks; where holes cannot be punched, zero its header at least."""
    if not punch_hole(descriptor, index * SLOT_BYTES, SLOT_BYTES):
        write_header(descriptor, index, None)


def write_header(descriptor: int, index: int, header: Header | None) -> None:
    """Rewrite one slot's header block alone (None: zeroes, no chunk), from this thread's aligned buffer."""
    buffer = slot_buffer()
    buffer[:HEADER_BYTES] = bytes(HEADER_BYTES)
    if header is not None:
        buffer[: HEADER_FORMAT.size] = pack_header(header)
    os.pwrite(descriptor, memoryview(buffer)[:HEADER_BYTES], index * SLOT_BYTES)
