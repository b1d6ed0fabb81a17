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
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

BLOCK = 1 << 20
"""Elements per block (4 MB of float32): small enough that a slowed thread stalls the rest for at most one
block (under a millisecond), large enough that dispatching one torch op per block costs about 1% of its
memory traffic (256K-element blocks measured 10-20% slower than whole-tensor ops here, 1M about 5%)."""


HUGE_PAGE = 1 << 21


def spans(numel: int, block: int = BLOCK) -> list[tuple[int, int]]:
    """The fixed partition of `numel` elements (or rows): [start, stop) of each block."""
    return [(start, min(start + block, numel)) for start in range(0, numel, block)]


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D view in C order (a copy only for the rare array stored in Fortran order)."""
    if tensor.dim() == 1:
        return tensor
    return tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)


def empty(shape: tuple[int, ...]) -> torch.Tensor:
    """Uninitialised float32 sums; those of 2 MB or more on transparent huge pages. malloc maps large
    allocations afresh, and their first write faults in 4 KB pages one by one: 40 MB of them cost 28-38 ms here,
    several times folding a reply into them, against 6 ms in 2 MB pages. The tensor starts on a 2 MB boundary,
    where the kernel can place a huge page (the mapping is 2 MB longer; the unused part is never touched)."""
    nbytes = 4 * math.prod(shape)
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=torch.float32)
    # private: a shared anonymous mapping is shared memory, which gets no huge pages
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without transparent huge pages: 4 KB pages then
        pass
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes].view(torch.float32).view(shape)


def blocks(*tensors: torch.Tensor | None) -> list[tuple[torch.Tensor | None, ...]]:
    """The same fixed partition of tensors of one shape, as views: one tuple per block (None stays None)."""
    parts = [None if tensor is None else _split(flat(tensor)) for tensor in tensors]
    count = max(len(part) for part in parts if part is not None)
    return list(zip(*(part if part is not None else [None] * count for part in parts)))


def _split(values: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # unsafe_split: views without autograd's bookkeeping (none of these tensors needs gradients), half the cost
    return (values,) if values.numel() <= BLOCK else values.unsafe_split(BLOCK)


class FoldPool:
    """`threads` workers (default: torch's thread count) that run block tasks; the calling thread works too."""

    threads: int
    _executor: ThreadPoolExecutor | None
    _local: threading.local

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, threads or torch.get_num_threads())
        self._executor = None
        self._local = threading.local()
        if self.threads > 1:
            self._executor = ThreadPoolExecutor(
                self.threads - 1, thread_name_prefix="hydrafl-fold", initializer=_pin_one_torch_thread
            )
            weakref.finalize(self, self._executor.shutdown, wait=False)

    def run(self, task: Callable[..., None], items: Sequence[tuple]) -> None:
        """task(*item) for every item, claimed dynamically; returns when all are done (re-raises the first error)."""
        claims = iter(items)  # next() on a list iterator is atomic under the GIL: each item is claimed once

        def work() -> None:
            with one_torch_thread():
                for item in claims:
                    task(*item)

        helpers = min(self.threads, len(items)) - 1
        futures = [self._executor.submit(work) for _ in range(helpers)] if self._executor and helpers > 0 else []
        try:
            work()
        finally:
            for future in futures:
                future.result()

    def scratch(self, numel: int) -> torch.Tensor:
        """A float32 buffer of the calling thread, reused from block to block (a fresh 1 MB allocation is an
        mmap and its page faults on every block)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None or buffer.numel() < numel:
            buffer = self._local.buffer = torch.empty(max(numel, BLOCK), dtype=torch.float32)
        return buffer[:numel]


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
    except (AttributeError, OSError, TypeError):  # no OpenMP runtime to reach: torch's own setter, process-wide
        return torch.set_num_threads


_set_thread_count = _omp_setter()


# --- block tasks, on views of one block each; `fresh`: the first reply, written into uninitialised sums ---


def axpy(total: torch.Tensor, values: torch.Tensor, alpha: float, fresh: bool) -> None:
    """total += alpha * values."""
    if fresh:
        torch.mul(values, alpha, out=total)
    else:
        total.add_(values, alpha=alpha)


def axpy_terms(total: torch.Tensor, terms: Sequence[tuple[torch.Tensor, float]], fresh: bool) -> None:
    """total += sum of alpha * values over the terms, in order (the block stays in cache between them)."""
    for values, alpha in terms:
        axpy(total, values, alpha, fresh)
        fresh = False


def masked_axpy(
    pool: FoldPool, total: torch.Tensor, counts: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
    alpha: float, counted: float, fresh: bool,
) -> None:
    """total += alpha * mask * values and counts += counted * mask. The float copy of the mask is one block
    in a reused buffer, converted from its bytes: torch casts uint8 to float32 with vector instructions, bool
    element by element (6x slower). First reply: the products written straight in (mask * values is exact,
    so alpha * it rounds as addcmul's alpha * mask * values does)."""
    float_mask = pool.scratch(mask.numel()).copy_(mask.view(torch.uint8))
    if fresh:
        torch.mul(values, alpha, out=total).mul_(float_mask)
        torch.mul(float_mask, counted, out=counts)
    else:
        total.addcmul_(float_mask, values, value=alpha)
        counts.add_(float_mask, alpha=counted)


def add_scalar(counts: torch.Tensor, value: float, fresh: bool) -> None:
    """counts += value (every coordinate of a whole-tensor slice counted)."""
    if fresh:
        counts.fill_(value)
    else:
        counts.add_(value)


def squared_norm(out: list[float], index: int, values: torch.Tensor, mask: torch.Tensor | None) -> None:
    """out[index] = the sum of squares of values (of mask * values), in float64."""
    block = values if mask is None else values * mask
    out[index] = float(torch.linalg.vector_norm(block, dtype=torch.float64)) ** 2


def masked_mean(pool: FoldPool, total: torch.Tensor, counts: torch.Tensor, covered: torch.Tensor) -> None:
    """total /= counts where counts > 0; covered = counts > 0. Where no site counted, total is already 0: every
    reply added mask * values there, 0 for finite values (the boundary refuses others), so 0 / 1e-30 stays 0.
    Counts are sums of positive weights, so "> 0" is "!= 0", which a cast to bool computes 4x faster than gt."""
    covered.copy_(counts)
    total.div_(torch.clamp(counts, min=1e-30, out=pool.scratch(counts.numel())))


def divide(total: torch.Tensor, divisor: float) -> None:
    """total /= divisor (the weighted mean)."""
    total.div_(divisor)


def zero(total: torch.Tensor) -> None:
    """total = 0: new sums are first touched (and their pages faulted in) by every thread."""
    total.zero_()
