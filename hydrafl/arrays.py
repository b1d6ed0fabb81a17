"""Conversions between Flower's ArrayRecord and named torch tensors, and the delta convention.

A site replies with `delta = start - end` for the coordinates it trained. Strategies that expect weights
(Flower's built-ins) get `start - delta` back, so they run unmodified.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

if TYPE_CHECKING:
    from hydrafl.subnet.slices import Slice


def to_record(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(_as_numpy(value)) for name, value in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array.numpy()) for name, array in record.items()}


def array_view(array: Array) -> np.ndarray:
    """A read-only view of an Array's values without copying them out of its serialised bytes (the copy
    `Array.numpy()` makes is most of the cost of aggregating large updates)."""
    buffer = io.BytesIO(array.data)
    major, _ = np.lib.format.read_magic(buffer)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read_header(buffer)
    values = np.frombuffer(array.data, dtype=dtype, count=math.prod(shape), offset=buffer.tell())
    return values.reshape(shape, order="F" if fortran_order else "C")


def sliced_record(record: ArrayRecord, slices: Mapping[str, Slice]) -> ArrayRecord:
    """The arrays `slices` names, each cut to its slice (what a site is sent of a subnetwork); arrays taken
    whole are shared with `record`, not copied."""
    return ArrayRecord(
        {
            name: record[name] if sl.dim is None else Array(sl.take(torch.from_numpy(record[name].numpy())).numpy())
            for name, sl in slices.items()
        }
    )


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of a record (what travels, before transport framing)."""
    return sum(len(array.data) for array in record.values())


def weights_from_delta(start: ArrayRecord, delta: ArrayRecord) -> ArrayRecord:
    """end = start - delta for every coordinate in `delta` (the inverse of a site's reply)."""
    return ArrayRecord(
        {name: Array((start[name].numpy() - array.numpy()).astype(start[name].dtype)) for name, array in delta.items()}
    )


def keep_dtypes(arrays: ArrayRecord, reference: ArrayRecord) -> ArrayRecord:
    """Cast back to the global model's dtypes: some Flower strategies (FedAdam, FedYogi) return float64,
    which would otherwise change the wire format and double the bytes of every later round."""
    if all(array.dtype == reference[name].dtype for name, array in arrays.items()):
        return arrays
    return ArrayRecord(
        {name: Array(array.numpy().astype(reference[name].dtype, copy=False)) for name, array in arrays.items()}
    )


def _as_numpy(value: torch.Tensor | np.ndarray) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().numpy()
    return np.ascontiguousarray(value)
