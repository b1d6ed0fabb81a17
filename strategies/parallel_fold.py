"""Folding replies into running sums block by block, on a small pool of threads that claim blocks one at a time.

Why blocks and not torch's own threads: torch splits each op evenly over its OpenMP team, so when another
process holds one core the whole op waits for the slowed thread (measured 16x slower here). Here every tensor is
cut into blocks of BLOCK elements; threads claim the next block when they are free, so a slowed thread only
does fewer blocks. Each op on a block runs on one torch thread (torch releases the GIL in it).

Why a fixed partition: the blocks depend only on a tensor's length, and each block sees the replies in the
order they were folded, so every element's sum is the same sequence of operations whatever the thread count:
results are bit-identical with 1 thread or many.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import torch

BLOCK = 1 << 20
"""Elements per block (4 MB of float32): small enough that a slowed thread stalls the rest for at most one
block (under a millisecond), large enough that dispatching one torch op per block costs about 1% of its
memory traffic (256K-element blocks measured 10-20% slower than whole-tensor ops here, 1M about 5%)."""


HUGE_PAGE = 1 << 21

SPARE_BYTES = 1 << 30
"""At most this much memory from dead `empty` tensors waits for reuse."""

_SPARES: dict[int, list[mmap.mmap]] = {}
"""Mappings whose tensors died, by length."""
_SPARES_LOCK = threading.RLock()  # a tensor may die, and recycle, while its thread holds the lock


def spans(numel: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """The fixed partition of `numel` elements (or rows): [start, stop) of each block."""
    return [(start, min(start + block, numel)) for start in range(0, numel, block)]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view in C order (a copy only for the rare array stored in Fortran order)."""
    if tensor.dim() == 1:
        return tensor
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def empty(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Uninitialised sums (float32 unless told); those of 2 MB or more on transparent huge pages, and on pages
    reused from a dead one of the same length. malloc maps large allocations afresh, and their first write faults
    in pages one by one: 40 MB of 4 KB pages cost 28-38 ms here, several times folding a reply into them, 6 ms in
    2 MB pages, and nothing when the pages are reused; a coordinator allocates the same sums every round. The
    tensor starts on a 2 MB boundary, where the kernel can place a huge page (the mapping is 2 MB longer; the
    unused part is never touched). When the tensor's storage dies (every view of it gone), its mapping waits in
    the spares for the next `empty` of its length (`_recycle`)."""
    nbytes = dtype.itemsize * math.prod(shape)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    length = nbytes + HUGE_PAGE
    with _SPARES_LOCK:
        spares = _SPARES.get(length)
        mapping = spares.pop() if spares else None
    if mapping is None:
        # private: a shared anonymous mapping is shared memory, which gets no huge pages
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages then
            pass
    raw = np.frombuffer(
        mapping, dtype=np.uint8
    )  # torch's storage holds this array, which holds the mapping
    finalizer = weakref.finalize(raw, _recycle, mapping)
    finalizer.atexit = False
    start = -raw.ctypes.data % HUGE_PAGE
    return torch.from_numpy(raw[start : start + nbytes]).view(dtype).view(shape)


def _recycle(mapping: mmap.mmap) -> None:
    """A dead tensor's mapping, kept for reuse while the spares hold under SPARE_BYTES (else unmapped). Its pages
    are freed lazily (MADV_FREE): the kernel takes them back only when it runs short of memory, and a later
    write finds them again if it did not."""
    if hasattr(mmap, "MADV_FREE"):
        mapping.madvise(mmap.MADV_FREE)
    with _SPARES_LOCK:
        if (
            sum(len(spare) for spares in _SPARES.values() for spare in spares) + len(mapping)
            <= SPARE_BYTES
        ):
            _SPARES.setdefault(len(mapping), []).append(mapping)


def blocks(*tensors: torch.Tensor | None) -> list[tuple[torch.Tensor | None, ...]]:
    """The same fixed partition of tensors of one shape, as views: one tuple per block (None stays None)."""
    flats = [None if tensor is None else flat(tensor) for tensor in tensors]
    if all(tensor is None or tensor.numel() <= BLOCK for tensor in flats):
        return [
            tuple(flats)
        ]  # one block: most layers, and this runs for each of them in every reply
    parts = [None if tensor is None else _split(tensor) for tensor in flats]
    count = max(len(part) for part in parts if part is not None)
    return list(zip(*(part if part is not None else [None] * count for part in parts), strict=True))


def _split(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # unsafe_split: views without autograd's bookkeeping (none of these tensors needs gradients), half the cost
    return (values,) if values.numel() <= BLOCK else values.unsafe_split(BLOCK)


class FoldPool:
    """`threads` workers (default: torch's thread count) that run block tasks; the calling thread works too.
    The helper threads are the process's (`_helpers`): shared by every pool of that size, started once."""

    threads: int

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or torch.get_num_threads())

    def run(self, task: Callable[..., None], items: Sequence[tuple]) -> None:
        """task(*item) for every item, claimed dynamically; returns when all are done (re-raises the first error)."""
        claims = iter(
            items
        )  # next() on a list iterator is atomic under the GIL: each item is claimed once

        def work() -> None:
            with one_torch_thread():
                for item in claims:
                    task(*item)

        helpers = min(self.threads, len(items)) - 1
        executor = _helpers(self.threads - 1) if helpers > 0 else None
        futures = [executor.submit(work) for _ in range(helpers)] if executor is not None else []
        try:
            work()
        finally:
            for future in futures:
                future.result()


_HELPERS: dict[int, ThreadPoolExecutor] = {}
_HELPERS_LOCK = threading.Lock()
_SCRATCH = threading.local()


def _helpers(count: int) -> ThreadPoolExecutor:
    """The process's `count` helper threads. An accumulator per round would otherwise start threads, and fault
    in their scratch buffers, every round (0.5 ms here). Another pool running at the same time only queues
    behind: its calling thread claims every block meanwhile."""
    with _HELPERS_LOCK:
        executor = _HELPERS.get(count)
        if executor is None:
            executor = _HELPERS[count] = ThreadPoolExecutor(
                count, thread_name_prefix="hydrafl-fold", initializer=_pin_one_torch_thread
            )
        return executor


def _forget_helpers() -> None:
    """A forked child has none of its parent's threads: it starts its own."""
    global _HELPERS_LOCK
    _HELPERS_LOCK = threading.Lock()
    _HELPERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def scratch(numel: int) -> torch.Tensor:
    """A float32 buffer of the calling thread, reused from block to block and round to round (a fresh 4 MB
    allocation is an mmap and its page faults)."""
    buffer = getattr(_SCRATCH, "buffer", None)
    if buffer is None or buffer.numel() < numel:
        buffer = _SCRATCH.buffer = torch.empty(max(numel, BLOCK), dtype=torch.float32)
    return buffer if buffer.numel() == numel else buffer[:numel]


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Torch ops of the calling thread run on one thread meanwhile (OpenMP's thread count is per thread, so
    torch's count elsewhere is untouched)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    _set_thread_count(1)
    try:
        yield
    finally:
        _set_thread_count(before)


def _pin_one_torch_thread() -> None:
    torch.get_num_threads()  # torch sets a new thread's count on its first op: let it, then override it
    _set_thread_count(1)


def _omp_setter() -> Callable[[int], None]:
    try:
        return ctypes.CDLL(None).omp_set_num_threads  # torch's OpenMP runtime, loaded globally
    except (
        AttributeError,
        OSError,
        TypeError,
    ):  # no OpenMP runtime to reach: torch's own setter, process-wide
        return torch.set_num_threads


_set_thread_count = _omp_setter()


# --- block tasks, on views of one block each; `fresh`: the first reply, written into uninitialised sums ---


def axpy(total: torch.Tensor, values: torch.Tensor, alpha: float, fresh: bool) -> None:
    """total += alpha * values."""
    if fresh:
        torch.mul(values, alpha, out=total)
    else:
        total.add_(values, alpha=alpha)


def axpy_terms(
    total: torch.Tensor, terms: Sequence[tuple[torch.Tensor, float]], fresh: bool
) -> None:
    """total += sum of alpha * values over the terms, in order (the block stays in cache between them)."""
    for values, alpha in terms:
        axpy(total, values, alpha, fresh)
        fresh = False


def masked_axpy(
    total: torch.Tensor,
    counts: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    alpha: float,
    counted: float,
    fresh: bool,
) -> None:
    """total += alpha * mask * values and counts += counted * mask. The mask is converted to float32 from its
    bytes: torch casts uint8 to float32 with vector instructions, bool element by element (6x slower). First
    reply: converted straight into the new counts, and the products written straight in (mask * values is
    exact, so alpha * it rounds as addcmul's alpha * mask * values does); later ones: into a reused buffer."""
    if fresh:
        counts.copy_(mask.view(torch.uint8))
        if alpha == counted:  # counts is alpha * mask: one pass over the new sums
            torch.mul(values, counts.mul_(counted), out=total)
        else:
            torch.mul(values, alpha, out=total).mul_(counts)
            counts.mul_(counted)
        return
    float_mask = scratch(mask.numel()).copy_(mask.view(torch.uint8))
    total.addcmul_(float_mask, values, value=alpha)
    counts.add_(float_mask, alpha=counted)


def add_scalar(counts: torch.Tensor, value: float, fresh: bool) -> None:
    """counts += value (every coordinate of a whole-tensor slice counted)."""
    if fresh:
        counts.fill_(value)
    else:
        counts.add_(value)


def squared_norm(
    out: list[float], index: int, values: torch.Tensor, mask: torch.Tensor | None
) -> None:
    """out[index] = the sum of squares of values (of mask * values), in float64."""
    block = values if mask is None else values * mask
    out[index] = float(torch.linalg.vector_norm(block, dtype=torch.float64)) ** 2


def masked_mean(total: torch.Tensor, counts: torch.Tensor, covered: torch.Tensor) -> None:
    """total /= counts where counts > 0; covered = counts > 0; counts are spent (clamped in place, 30% faster
    than through a buffer). Where no site counted, total is already 0: every reply added mask * values there, 0 for
    finite values (the boundary refuses others), so 0 / 1e-30 stays 0. Counts are sums of positive weights, so
    "> 0" is "!= 0", which a cast to bool computes 4x faster than gt."""
    covered.copy_(counts)
    total.div_(counts.clamp_(min=1e-30))


def divide(total: torch.Tensor, divisor: float) -> None:
    """total /= divisor (the weighted mean)."""
    total.div_(divisor)


def zero(total: torch.Tensor) -> None:
    """total = 0: new sums are first touched (and their pages faulted in) by every thread."""
    total.zero_()
