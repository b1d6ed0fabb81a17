"""A masked sum a window at a time: a mask's words made from any offset equal that slice of the whole mask, a
sum in a file equals one in memory, and a vector that fails to read midway is taken back out whole."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hydrafl.secagg import SecAggError, crypto, field_sum
from hydrafl.secagg.field_sum import WINDOW_WORDS, FieldSum, windows


def test_a_ranged_mask_is_the_slice_of_the_whole_mask_from_any_offset():
    seed = os.urandom(crypto.KEY_BYTES)
    whole = crypto.mask(seed, 4096)
    rng = np.random.default_rng(3)
    cases = [(0, 4096), (0, 0), (16, 48), (15, 17), (4095, 4096)]
    cases += [tuple(int(n) for n in sorted(rng.integers(0, 4097, 2))) for _ in range(40)]
    for start, stop in cases:
        np.testing.assert_array_equal(
            crypto.mask_range(seed, start, stop - start), whole[start:stop]
        )
    assert any(start % 16 for start, _ in cases)  # offsets off the 16-word blocks are among them
    assert not np.array_equal(crypto.mask_range(os.urandom(32), 0, 64), whole[:64])
    with pytest.raises(SecAggError, match="outside"):
        crypto.mask_range(seed, crypto.MASK_WORDS - 1, 2)


def _file_sum(tmp_path, length: int) -> FieldSum:
    path = tmp_path / "sum"
    with path.open("wb") as handle:
        handle.write(b"header--")
        handle.truncate(8 + 4 * length)
    return FieldSum(length, path, 8)


def _reader(vector: np.ndarray, fail_at: int | None = None):
    def words(offset: int, count: int) -> np.ndarray:
        if fail_at is not None and offset <= fail_at < offset + count:
            raise OSError("a stored chunk is gone")
        return vector[offset : offset + count]

    return words


def test_a_sum_in_a_file_equals_one_in_memory_mod_2_to_the_32(tmp_path):
    length = 2 * WINDOW_WORDS + 12345  # three windows, the last one short
    assert list(windows(0, length))[-1] == (2 * WINDOW_WORDS, 12345)
    rng = np.random.default_rng(0)
    vectors = [rng.integers(0, 2**32, length, dtype=np.uint32) for _ in range(3)]
    in_memory, on_disk = FieldSum(length), _file_sum(tmp_path, length)
    for vector in vectors:
        in_memory.add(_reader(vector))
        on_disk.add(_reader(vector))
    expected = (vectors[0].astype(np.uint64) + vectors[1] + vectors[2]) % 2**32
    np.testing.assert_array_equal(on_disk.read(0, length), expected)
    np.testing.assert_array_equal(in_memory.read(0, length), expected)
    np.testing.assert_array_equal(
        on_disk.read(WINDOW_WORDS - 3, 7), expected[WINDOW_WORDS - 3 :][:7]
    )
    assert (tmp_path / "sum").read_bytes()[:8] == b"header--"  # the sum stays in its region
    on_disk.close()


def test_a_vector_that_fails_to_read_midway_is_taken_back_out_whole(tmp_path):
    length = 3 * WINDOW_WORDS
    rng = np.random.default_rng(1)
    first, broken = (rng.integers(0, 2**32, length, dtype=np.uint32) for _ in range(2))
    total = _file_sum(tmp_path, length)
    total.add(_reader(first))
    with pytest.raises(OSError, match="gone"):
        total.add(_reader(broken, fail_at=2 * WINDOW_WORDS + 5))  # after two windows were added
    np.testing.assert_array_equal(total.read(0, length), first)
    with pytest.raises(SecAggError, match="must be 7 uint32 words"):
        FieldSum(7).add(lambda offset, count: np.zeros(count, np.int64))
    calls = []

    def failing_twice(
        offset: int, count: int
    ) -> np.ndarray:  # the take-back fails too: the sum is lost
        calls.append(offset)
        if offset >= WINDOW_WORDS or len(calls) > 2:
            raise OSError("the disk is gone")
        return broken[offset : offset + count]

    with pytest.raises(OSError, match="disk is gone"):
        total.add(failing_twice)
    with pytest.raises(SecAggError, match="the masked sum is lost.*the round halts"):
        total.read(0, 1)


def test_a_sum_whose_file_fails_a_write_is_lost_and_says_so(tmp_path, monkeypatch):
    length = 2 * WINDOW_WORDS
    total = _file_sum(tmp_path, length)
    total.add(_reader(np.ones(length, np.uint32)))
    writes = []

    def full_disk(descriptor: int, data, offset: int) -> int:
        writes.append(offset)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(field_sum.os, "pwrite", full_disk)
    with pytest.raises(OSError, match="No space"):
        total.add(_reader(np.ones(length, np.uint32)))
    assert len(writes) == 1 and "writing it failed" in total.lost  # no take-back of a torn window
    with pytest.raises(SecAggError, match="the masked sum is lost: writing it failed"):
        total.read(0, 1)
