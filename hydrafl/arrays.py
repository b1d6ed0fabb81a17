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
from flwr.common.constant import SType

from hydrafl.tensor_files import OnDiskArray

if TYPE_CHECKING:
    from hydrafl.subnet.slices import Slice


def to_record(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    return ArrayRecord({name: Array(_as_numpy(value)) for name, value in tensors.items()})


def from_record(record: ArrayRecord) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array.numpy()) for name, array in record.items()}


def array_view(array: Array) -> np.ndarray:
    """A read-only view of an Array's values without copying them out of its serialised bytes (the copy
    `Array.numpy()` makes is most of the cost of aggregating large updates). The bytes may be any buffer (bytes,
    a memory-mapped file, a memoryview): only the header is copied, to be parsed. An `OnDiskArray`'s values are
    read from its storage, a `HeldArray`'s are its own."""
    if isinstance(array, OnDiskArray):
        return array.view()
    if isinstance(array, HeldArray):  # its values, never serialised for a view
        values = array.numpy().view()
        values.flags.writeable = False
        return values
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


class HeldArray(Array):
    """An Array whose values are in memory already (a site's end weights, just computed; a tensor read ahead
    from disk): `numpy()` hands the values over without a decode, and their serialised bytes are made only if
    something reads `data`. It lives only for the strategy's aggregation, which owns the values (as it owns what
    `Array.numpy()` returns)."""

    def __init__(self, values: np.ndarray) -> None:
        # not Array.__init__: it would serialise the values, the one cost this class exists to avoid
        self.__dict__.update(
            dtype=str(values.dtype), shape=tuple(values.shape), stype=SType.NUMPY, _values=values
        )

    @property
    def data(self) -> bytes:  # type: ignore[override]
        if "_data" not in self.__dict__:
            self.__dict__["_data"] = Array.from_numpy_ndarray(self.__dict__["_values"]).data
        return self.__dict__["_data"]

    def numpy(self) -> np.ndarray:
        return self.__dict__["_values"]


def sliced_record(record: ArrayRecord, slices: Mapping[str, Slice]) -> ArrayRecord:
    """The arrays `slices` names, each cut to its slice (what a site is sent of a subnetwork); arrays taken
    whole are shared with `record`, not copied, and slices of arrays on disk are taken when read."""
    sliced = ArrayRecord()  # item by item: ArrayRecord(dict) would copy each into a plain Array
    for name, sl in slices.items():
        array = record[name]
        if sl.dim is None:
            sliced[name] = array
        elif isinstance(array, OnDiskArray):
            sliced[name] = SlicedArray(array, sl)
        else:
            sliced[name] = Array(sl.take(torch.from_numpy(array.numpy())).numpy())
    return sliced


class SlicedArray(OnDiskArray):
    """A slice of an array kept on disk, taken when read: what a site is sent of a model larger than memory,
    made a tensor at a time as it is sent."""

    def __init__(self, base: OnDiskArray, sl: Slice) -> None:
        super().__init__(base.dtype, sl.taken_shape(base.shape))
        self.__dict__.update(base=base, slice=sl)

    def numpy(self) -> np.ndarray:
        base: OnDiskArray = self.__dict__["base"]
        return self.__dict__["slice"].take(torch.from_numpy(base.numpy())).numpy()


def record_nbytes(record: ArrayRecord) -> int:
    """Payload bytes of a record (what travels, before transport framing)."""
    return sum(
        array.serialised_nbytes if isinstance(array, OnDiskArray) else len(array.data)
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
