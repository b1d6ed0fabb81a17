"""The fold's thread pool: a fixed block partition, dynamic claiming (a slowed thread does fewer blocks, it
never holds the others up), one torch thread per worker, errors re-raised."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from hydrafl.strategies import parallel_fold as fold


def test_the_partition_depends_on_the_length_only():
    assert fold.spans(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert fold.spans(0, 4) == []
    a, b = torch.arange(2 * fold.BLOCK + 5, dtype=torch.float32), torch.zeros(2 * fold.BLOCK + 5)
    blocks = fold.blocks(a, None, b.view(1, -1))
    assert [tuple(x.numel() for x in block if x is not None) for block in blocks] == [
        (fold.BLOCK, fold.BLOCK),
        (fold.BLOCK, fold.BLOCK),
        (5, 5),
    ]
    assert all(block[1] is None for block in blocks)
    assert blocks[2][0][0].item() == 2 * fold.BLOCK  # views, in order


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_item_runs_once_on_one_torch_thread(threads):
    seen, torch_threads = [], set()
    lock = threading.Lock()

    def task(index: int) -> None:
        with lock:
            seen.append(index)
            torch_threads.add(torch.get_num_threads())

    before = torch.get_num_threads()
    fold.FoldPool(threads).run(task, [(i,) for i in range(50)])
    assert sorted(seen) == list(range(50))
    assert torch_threads == {1}
    assert torch.get_num_threads() == before  # the calling thread's count is restored


def test_a_slowed_thread_does_fewer_blocks_and_never_stalls_the_rest():
    """Item 0 takes 0.5 s (a thread the OS took the core from); the other thread claims every other item."""
    owners: dict[int, str] = {}

    def task(index: int) -> None:
        if index == 0:
            time.sleep(0.5)
        owners[index] = threading.current_thread().name

    fold.FoldPool(2).run(task, [(i,) for i in range(40)])
    slowed = owners[0]
    assert (
        sum(owner == slowed for owner in owners.values()) <= 2
    )  # claimed item 0 and at most one before it


def test_an_error_in_a_task_is_raised_after_the_others_finish():
    done = []

    def task(index: int) -> None:
        if index == 3:
            raise ValueError("block 3")
        done.append(index)

    with pytest.raises(ValueError, match="block 3"):
        fold.FoldPool(2).run(task, [(i,) for i in range(8)])
    assert sorted(done) == [0, 1, 2, 4, 5, 6, 7]


def test_large_sums_are_writable_and_the_right_shape():
    small, large = (
        fold.empty((3, 4)),
        fold.empty((1024, 1024)),
    )  # 4 MB: on huge pages where the kernel has them
    large.fill_(2.0)
    assert (
        small.shape == (3, 4)
        and large.shape == (1024, 1024)
        and float(large.sum()) == 2.0 * 1024 * 1024
    )


def test_dead_sums_pages_are_reused_and_flags_fit_too():
    counts = fold.empty((1024, 1024))
    address = counts.data_ptr()
    view = counts[512:]
    del counts
    assert fold.empty((1024, 1024)).data_ptr() != address  # a view keeps the pages in use
    del view  # the last view of them, and the new sums above, are gone
    assert fold.empty((1024, 1024)).data_ptr() == address  # the same pages, not faulted in again
    flags = fold.empty((3 << 20,), torch.bool).fill_(True)
    assert flags.dtype == torch.bool and bool(flags.all())


def test_pools_share_the_process_helper_threads():
    fold.FoldPool(3).run(lambda index: None, [(i,) for i in range(8)])
    before = threading.active_count()
    for _ in range(5):
        fold.FoldPool(3).run(lambda index: None, [(i,) for i in range(8)])
    assert threading.active_count() == before
