"""The coordinator's running sum of masked vectors over Z_{2^32}, added to and read a window at a time: in
memory, or in a file region, so that a vector larger than memory passes through a window of `WINDOW_WORDS`.

A vector is added whole or not at all: a window that fails to read (a stored chunk gone bad) takes back the
windows added before it, so the site fails alone and the others' sum stays right. Only when taking back fails
too, or writing the sum fails, is the sum lost (`lost`), and every later use says so (the round halts,
applying nothing).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from hydrafl.secagg.params import SecAggError

WINDOW_WORDS = 1 << 18
"""Words added or read at once (1 MiB of uint32: one upload chunk of the coordinator's blob store)."""

Words = Callable[[int, int], np.ndarray]
"""Words [offset, offset + count) of a vector, read when asked for (uint32)."""


def windows(start: int, stop: int, size: int = WINDOW_WORDS) -> Iterator[tuple[int, int]]:
    """(offset, count) of consecutive windows of at most `size` words covering [start, stop)."""
    for offset in range(start, stop, size):
        yield offset, min(size, stop - offset)


class FieldSum:
    """The sum of uint32 vectors of `length` words, mod 2^32: in memory, or, given `path`, in that file's
    `length` words from byte `offset` (zeros to start with: a fresh sparse file is an empty sum)."""

    def __init__(self, length: int, path: str | Path | None = None, offset: int = 0) -> None:
        self.length = length
        self._memory = np.zeros(length, np.uint32) if path is None else None
        self._descriptor = -1 if path is None else os.open(path, os.O_RDWR)
        self._offset = offset
        self._lost = ""

    def add(self, words: Words) -> None:
        """Add one vector, window by window; a SecAggError, or the reader's own error, leaves the sum as it was."""
        self._check()
        added = 0
        try:
            for offset, count in windows(0, self.length):
                self._add(offset, _checked(words(offset, count), count), np.add)
                added = offset + count
        except BaseException as error:
            if self._lost:
                raise
            try:
                for offset, count in windows(0, added):
                    self._add(offset, _checked(words(offset, count), count), np.subtract)
            except BaseException as again:
                self._lost = self._lost or (
                    f"a vector that failed to read ({error}) could not be taken back out ({again})"
                )
            raise

    def read(self, offset: int, count: int) -> np.ndarray:
        """Words [offset, offset + count) of the sum, a fresh array the caller owns."""
        self._check()
        if offset < 0 or offset + count > self.length:
            raise SecAggError(
                f"words {offset}..{offset + count} are outside the sum's {self.length}"
            )
        if self._memory is not None:
            return self._memory[offset : offset + count].copy()
        out = np.empty(count, np.uint32)
        raw = out.view(np.uint8).data
        start = self._offset + 4 * offset
        while raw:
            done = os.preadv(self._descriptor, [raw], start)
            if not done:
                raise SecAggError("the masked sum's file ends early (truncated?)")
            raw, start = raw[done:], start + done
        return out

    @property
    def lost(self) -> str:
        """Why the sum is lost ("" while it holds)."""
        return self._lost

    def close(self) -> None:
        if self._descriptor >= 0:
            os.close(self._descriptor)
            self._descriptor = -1

    def _add(self, offset: int, values: np.ndarray, op: Callable[..., np.ndarray]) -> None:
        if self._memory is not None:
            window = self._memory[offset : offset + values.size]
            op(window, values, out=window)
            return
        total = self.read(offset, values.size)
        op(total, values, out=total)
        raw = total.view(np.uint8).data
        start = self._offset + 4 * offset
        try:
            while raw:
                done = os.pwrite(self._descriptor, raw, start)
                raw, start = raw[done:], start + done
        except (
            BaseException
        ) as error:  # a window written in part: no count of windows takes it back
            self._lost = f"writing it failed ({error})"
            raise

    def _check(self) -> None:
        if self._lost:
            raise SecAggError(f"the masked sum is lost: {self._lost}; the round halts")


def _checked(values: np.ndarray, count: int) -> np.ndarray:
    if not isinstance(values, np.ndarray) or values.dtype != np.uint32 or values.shape != (count,):
        raise SecAggError(f"a window of a masked vector must be {count} uint32 words")
    return values
