"""Secure aggregation of a model kept on disk (`driver.kept_on_disk`): the masked sum lives in a file of the
round's folder, each site's masked vector is added into it a window at a time from where its upload put it,
and the survivors' weighted mean update (a subnetwork strategy's per-coordinate sums and weights) is unmasked
and decoded a window at a time into tensor files, which the strategy then steps on tensor by tensor
(`strategies.by_tensor`). Resident memory is a few windows
(`field_sum.WINDOW_WORDS`) whatever the model's size, and every window is computed as the in-memory round
computes it, so the mean is the in-memory round's, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from flwr.app import Array, ArrayRecord

from hydrafl.arrays import array_view
from hydrafl.secagg import SecAggError, SecAggParams
from hydrafl.secagg.field_sum import FieldSum, Words, windows
from hydrafl.secagg.quantize import decode_values
from hydrafl.secagg.server import Unmasked
from hydrafl.strategies.by_tensor import RoundFiles
from hydrafl.tensor_files import OnDiskArray, as_record

MASKED = "masked"
"""The round files' kind of the masked sum (`round-NNNNN-masked-*.safetensors`, removed when the round is
decoded; one a crash leaves is swept at the next checkpoint)."""
MEAN = "secured"
"""The round files' kind of the decoded mean update (or per-coordinate sums) the strategy steps on."""
WEIGHTS = "secweights"
"""The round files' kind of the decoded per-coordinate weight sums a subnetwork strategy steps on."""


@contextmanager
def sum_file(files: RoundFiles, length: int) -> Iterator[FieldSum]:
    """An empty masked sum of `length` words in a file of the round's folder, removed on leaving."""
    writer = files.writer(MASKED, {"sum": ("uint32", (length,))})
    try:
        place = writer.mapped()["sum"]
        total = FieldSum(length, place.path, place.offset)
        try:
            yield total
        finally:
            total.close()
    finally:
        writer.discard()


def words_of(array: Array) -> Words:
    """A reply's masked vector, read a window at a time: from where its upload put it (`OnDiskArray`), or from
    its bytes in memory (a view, never a copy of the whole)."""
    if isinstance(array, OnDiskArray):
        return lambda offset, count: np.frombuffer(
            array.read_bytes(4 * offset, 4 * count), "<u4"
        ).astype(np.uint32, copy=False)
    values = array_view(array).reshape(-1)
    return lambda offset, count: values[offset : offset + count]


def decode_mean(
    unmasked: Unmasked,
    num_sites: int,
    params: SecAggParams,
    arrays: ArrayRecord,
    names: Sequence[str],
    files: RoundFiles,
) -> tuple[dict[str, ArrayRecord], int]:
    """({"arrays": the survivors' weighted mean update, in `arrays`' dtypes and shapes, in a tensor file of the
    round's folder}; their total weight) from the unmasked sum of vectors laid out [weight, quantised update].
    SecAggError when the weights sum to 0 (nothing to divide by)."""
    weight = unmasked.read(0, 1).astype(np.int64)[0]
    if not weight:
        raise SecAggError("the survivors' weights sum to 0; the round halts")
    layout = {name: (str(arrays[name].dtype), tuple(arrays[name].shape)) for name in names}
    writer = files.writer(MEAN, layout)
    try:
        offset = 1
        for name, (dtype, shape) in layout.items():
            size, itemsize = math.prod(shape), np.dtype(dtype).itemsize
            for start, count in windows(offset, offset + size):
                mean = decode_values(unmasked.read(start, count), num_sites, params)
                mean /= weight  # in place: the in-memory round's `weighted / weight`, bit for bit
                writer.write_at(name, (start - offset) * itemsize, mean.astype(dtype))
            offset += size
        return {"arrays": as_record(writer.close(durable=False))}, int(weight)
    except BaseException:
        writer.discard()
        raise


def decode_sums(
    unmasked: Unmasked,
    num_sites: int,
    params: SecAggParams,
    arrays: ArrayRecord,
    names: Sequence[str],
    files: RoundFiles,
) -> tuple[dict[str, ArrayRecord], int]:
    """({"sums": the survivors' per-coordinate weighted sums, "weights": their per-coordinate weight sums},
    float32 in `arrays`' shapes, each in a tensor file of the round's folder; the largest weight) from the
    unmasked sum of vectors laid out [a weight per coordinate, quantised update]: what a subnetwork strategy
    steps on (`hooks.TakesSecureSums`). SecAggError when every weight is 0."""
    layout = {name: ("float32", tuple(arrays[name].shape)) for name in names}
    size = sum(math.prod(shape) for _, shape in layout.values())
    sums, weights = files.writer(MEAN, layout), files.writer(WEIGHTS, layout)
    largest = 0
    try:
        offset = 0
        for name, (_, shape) in layout.items():
            for start, count in windows(offset, offset + math.prod(shape)):
                weight = unmasked.read(start, count)
                largest = max(largest, int(weight.max()))
                at = (start - offset) * 4
                # uint32 to float32 rounds once, as the in-memory round's exact float64 then float32 does
                weights.write_at(name, at, weight.astype(np.float32))
                del weight
                summed = decode_values(unmasked.read(size + start, count), num_sites, params)
                sums.write_at(name, at, summed.astype(np.float32))
            offset += math.prod(shape)
        if not largest:
            raise SecAggError("the survivors' weights sum to 0; the round halts")
        records = {"sums": sums.close(durable=False), "weights": weights.close(durable=False)}
        return {key: as_record(tensors) for key, tensors in records.items()}, largest
    except BaseException:
        sums.discard()
        weights.discard()
        raise
