"""Chunk buffers kept in the heap between chunks, and a long-lived process's memory kept between rounds.

A chunk stream allocates and frees a ~1 MiB buffer per chunk on gRPC's threads. With glibc's defaults each one
is mapped for itself and handed back to the kernel when freed (a fresh mmap, or a trimmed per-thread heap), so
every chunk's buffer is faulted in again page by page. Measured on the coordinator's GetChunks: 0.55 s per
256 MiB with the defaults, 0.2 s (the raw gRPC stream's speed) with these settings. Linux/glibc only; elsewhere
nothing changes.

A site or coordinator process also handles a whole model every round (a download assembled, an update
received), and glibc hands every buffer over 32 MiB, and any free memory at the top of its heap beyond a few
MiB, back to the kernel. Memory fresh from the kernel is what costs most here: on this machine's VM about 1-2 s
of system time per GiB (the host backs each page at its first touch), against none for memory the process
touched before. `keep_freed_memory` keeps up to 2 GiB of freed memory for the next round: measured on a 1 GiB
download (with `client.download` letting each tensor's chunks go), 4.0 s -> 0.93 s, 525,000 page faults ->
none. The price is that the process's resident memory stays near its peak, as with jemalloc or tcmalloc; so
only the `hydrafl site` and `hydrafl server` processes ask for it (`hydrafl.cli.main`), never a library
caller. It also moves where large buffers start in memory, which can change the last bits of float sums
(numpy's vectorised loops split at alignment boundaries): one more reason to keep it out of processes that
compare numbers with recorded ones.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
M_ARENA_MAX = -8
MMAP_THRESHOLD = 4 << 20
"""Allocations below this come from the heap and are reused once freed (a chunk and its wire form fit)."""
TRIM_THRESHOLD = 32 << 20
"""A heap returns free memory to the kernel only beyond this: a few chunks' worth stays, for the next ones."""
KEPT_BYTES = (1 << 31) - 1
"""With `keep_freed_memory`: the free memory the heap keeps, even when it gives the rest back (mallopt's largest
value, 2 GiB)."""


def keep_chunk_buffers() -> bool:
    """Tune this process's malloc (once per process is enough; repeating is harmless); False where there is no
    glibc `mallopt`."""
    return _mallopt((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def keep_freed_memory() -> bool:
    """Every allocation from one heap that keeps up to KEPT_BYTES free for reuse (no per-buffer mappings, no
    per-thread heaps, which glibc unmaps when emptied). Call it first thing in a process's entry point, before
    threads start; False where there is no glibc `mallopt`."""
    return _mallopt(
        (M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, KEPT_BYTES), (M_TOP_PAD, KEPT_BYTES)
    )


def _mallopt(*settings: tuple[int, int]) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own libc
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    applied = [
        bool(mallopt(option, value)) for option, value in settings
    ]  # each one, even after a failure
    return all(applied)
