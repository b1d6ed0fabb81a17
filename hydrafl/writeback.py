"""Starting a file's writeback without waiting for it: a writer that fsyncs at the end finds its data mostly
on disk by then, and the disk writes while the writer computes what comes next."""

from __future__ import annotations

import ctypes
import sys

_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(descriptor: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing a file's dirty pages (`nbytes` from `offset`; 0: to the end) now, without
    waiting (Linux; elsewhere the next fsync writes everything)."""
    if _LIBC is not None:
        _LIBC.sync_file_range(
            descriptor, ctypes.c_longlong(offset), ctypes.c_longlong(nbytes), _SYNC_FILE_RANGE_WRITE
        )
