"""What the chunk stores ask of the filesystem: one sync for everything written, and unbuffered files."""

from __future__ import annotations

import ctypes
import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


@dataclass(frozen=True, slots=True)
class ChunkStat:
    """What a sweep needs of a stored chunk: when it was last written (or re-put) and its size."""

    modified: float
    nbytes: int


def sync_filesystem(root: Path) -> None:
    """Make everything written under `root` before this call durable, data and names: one syncfs (Linux), a
    whole-system sync elsewhere."""
    if _LIBC is None:
        os.sync()
        return
    descriptor = os.open(root, os.O_RDONLY)
    try:
        if _LIBC.syncfs(descriptor) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs of {root}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


def open_file(path: Path, flags: int, *, direct: bool = False) -> int:
    """Open `path`; with `direct`, past the page cache (O_DIRECT) where the filesystem allows it (tmpfs refuses it,
    other systems lack it), else through the cache."""
    if direct and hasattr(os, "O_DIRECT"):
        try:
            return os.open(path, flags | os.O_DIRECT, 0o644)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
    return os.open(path, flags, 0o644)


@contextmanager
def opened(path: Path, flags: int, *, direct: bool = False) -> Iterator[int]:
    descriptor = open_file(path, flags, direct=direct)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def punch_hole(descriptor: int, offset: int, length: int) -> bool:
    """Free a range's blocks (reads give zeros); False where the filesystem cannot."""
    keep_size_punch_hole = 0x01 | 0x02
    if _LIBC is None:
        return False
    return (
        _LIBC.fallocate(
            descriptor, keep_size_punch_hole, ctypes.c_longlong(offset), ctypes.c_longlong(length)
        )
        == 0
    )


def preallocate(descriptor: int, offset: int, length: int) -> None:
    """Allocate blocks ahead of writes (an unbuffered write into allocated space is what a disk does fastest)."""
    if not hasattr(os, "posix_fallocate"):  # macOS: the writes allocate as they go
        return
    try:
        os.posix_fallocate(descriptor, offset, length)
    except OSError:  # not supported by this file system: likewise
        pass
