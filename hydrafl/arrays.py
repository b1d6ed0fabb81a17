"""Conversions between Flower's ArrayRecord and named torch tensors, and the delta convention.

A site replies with `delta = start - end` for the coordinates it trained. Strategies that expect weights
(Flower's built-ins) get `start - delta` back, so they run unmodified.
"""

from __future__ import annotations

import functools
import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from hydrafl.tensor_files import MappedArray

if TYPE_CHECKING:
    from hydrafl.subnet.slices import Slice


def to_record(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(_as_numpy(value)) for name, value in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array.numpy()) for name, array in record.items()}


def record_of(arrays: Mapping[str, Array]) -> ArrayRecord:
    """An ArrayRecord of these very Arrays. `ArrayRecord(dict)` rebuilds each Array from its serialised `data`,
    which for a `MappedArray` would read the whole tensor into memory."""
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


def array_view(array: Array) -> np.ndarray:
    """A read-only view of an Array's values without copying them out of its serialised bytes (the copy
    `Array.numpy()` makes is most of the cost of aggregating large updates). The bytes may be any buffer (bytes,
    a memory-mapped file, a memoryview): only the header is copied, to be parsed. A `MappedArray`'s values are
    mapped from its file."""
    if isinstance(array, MappedArray):
        return array.view()
    data = memoryview(array.data).cast("B")
    major, _ = np.lib.format.read_magic(io.BytesIO(data[:8].tobytes()))
    length_bytes = 2 if major == 1 else 4  # the header's own length follows the 8-byte magic
    header_end = 8 + length_bytes + int.from_bytes(data[8 : 8 + length_bytes], "little")
    header = data[:header_end].tobytes()
    parse = (
        _npy_header if len(header) <= 4096 else _npy_header.__wrapped__
    )  # only ordinary headers are kept
    shape, fortran_order, dtype = parse(header, major)
    values = np.frombuffer(data, dtype=dtype, count=math.prod(shape), offset=header_end)
    return values.reshape(shape, order="F" if fortran_order else "C")


@functools.lru_cache(maxsize=1024)
def _npy_header(header: bytes, major: int) -> tuple[tuple[int, ...], bool, np.dtype]:
    """numpy's own parse of an .npy header, remembered: it evaluates the header as a Python literal (0.1 ms,
    a few percent of folding a 4 MB array), and a round's replies repeat the same few headers."""
    buffer = io.BytesIO(header)
    np.lib.format.read_magic(buffer)
    read_header = (
        np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    )
    return read_header(buffer)


def sliced_record(record: ArrayRecord, slices: Mapping[str, Slice]) -> ArrayRecord:
    """The arrays `slices` names, each cut to its slice (what a site is sent of a subnetwork); arrays taken
    whole are shared with `record`, not copied."""
    return ArrayRecord(
        {
            name: record[name]
            if sl.dim is None
            else Array(sl.take(torch.from_numpy(record[name].numpy())).numpy())
            for name, sl in slices.items()
        }
    )


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of a record (what travels, before transport framing)."""
    return sum(
        array.serialised_nbytes if isinstance(array, MappedArray) else len(array.data)
        for array in record.values()
    )


def weights_from_delta(start: ArrayRecord, delta: ArrayRecord) -> ArrayRecord:
    """end = start - delta for every coordinate in `delta` (the inverse of a site's reply)."""
    return ArrayRecord(
        {
            name: Array((start[name].numpy() - array.numpy()).astype(start[name].dtype))
            for name, array in delta.items()
        }
    )


def keep_dtypes(arrays: ArrayRecord, reference: ArrayRecord) -> ArrayRecord:
    """Cast back to the global model's dtypes: some Flower strategies (FedAdam, FedYogi) return float64,
    which would otherwise change the wire format and double the bytes of every later round."""
    if all(array.dtype == reference[name].dtype for name, array in arrays.items()):
        return arrays
    return ArrayRecord(
        {
            name: Array(array.numpy().astype(reference[name].dtype, copy=False))
            for name, array in arrays.items()
        }
    )


def _as_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(value)
