"""Tensors in safetensors files, written and read one tensor at a time, so a model larger than memory passes
through a process that holds one tensor of it.

`TensorFileWriter` writes the header first (the layout is known before the values: a model's names, dtypes and
shapes), then each tensor's bytes at its place as they are computed, in any order; `open_tensors` gives a file's
tensors as `MappedArray`s, Flower Arrays whose values stay in the file until something reads them. Any
safetensors reader (`safetensors.safe_open`, `transformers`) reads these files; files safetensors writes read
back here.
"""

from __future__ import annotations

import io
import json
import math
import os
import struct
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from flwr.common.constant import SType

from hydrafl.writeback import start_writeback

SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
NUMPY_DTYPES = {code: name for name, code in SAFETENSORS_DTYPES.items()}
_HEADER_LIMIT = 100 << 20
"""safetensors' own limit on a header's size: a file claiming more is not one."""

Layout = Mapping[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (numpy dtype name, shape)."""


class TensorFileError(ValueError):
    """A file that is not a readable safetensors file, or a tensor that does not fit the file's layout."""


class OnDiskArray(Array):
    """A Flower Array whose values stay on disk until read: `numpy()` reads them (a fresh array, which the caller
    owns, as `Array.numpy()` gives), `view()` gives them read-only; nothing stays in memory between reads. Its
    serialised `data` is made only if something asks for it (Flower's own encoders)."""

    checked_finite: bool = False
    """Every value was checked finite when it was stored (the coordinator's edge checks uploads)."""

    def __init__(self, dtype: str, shape: tuple[int, ...]) -> None:
        # not Array.__init__: it wants the values in memory, which is what this class exists to avoid
        self.__dict__.update(dtype=dtype, shape=tuple(shape), stype=SType.NUMPY)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def numpy(self) -> np.ndarray:
        return self.read_into(np.empty(self.shape, self.dtype))

    def read_into(self, out: np.ndarray) -> np.ndarray:
        """The values written into `out` (C-ordered, of this array's dtype and shape) and returned: a reader of
        many tensors reuses its buffers (fresh pages cost more than the read itself). A kind of OnDiskArray
        implements this, or `numpy`, or both."""
        np.copyto(out, self.numpy())
        return out

    def view(self) -> np.ndarray:
        """The values, read-only, without a copy where the storage allows one."""
        values = self.numpy()
        values.flags.writeable = False
        return values

    def read_bytes(self, start: int, count: int) -> bytes:
        """`count` raw bytes of the values from byte `start` (a chunk to send, a window of a vector larger than
        memory). Here through the whole values; a kind whose storage reads a window alone (`MappedArray`, the
        coordinator's stored replies) reads only it."""
        _check_window(start, count, self.nbytes)
        return self.numpy().reshape(-1).view(np.uint8)[start : start + count].tobytes()

    @property
    def data(self) -> bytes:  # type: ignore[override]
        return self._npy_header() + self.numpy().tobytes()

    @property
    def serialised_nbytes(self) -> int:
        """`len(self.data)`, without reading the values."""
        return len(self._npy_header()) + self.nbytes

    def _npy_header(self) -> bytes:
        header = io.BytesIO()
        described = {
            "descr": np.lib.format.dtype_to_descr(np.dtype(self.dtype)),
            "fortran_order": False,
            "shape": self.shape,
        }
        np.lib.format.write_array_header_1_0(header, described)
        return header.getvalue()


class MappedArray(OnDiskArray):
    """A tensor in a file at `offset` (a safetensors file's, here): `view()` maps it read-only, and its pages leave
    the process with the last reference to the view."""

    def __init__(self, path: str | Path, offset: int, dtype: str, shape: tuple[int, ...]) -> None:
        super().__init__(dtype, shape)
        self.__dict__.update(path=str(path), offset=offset)

    @property
    def path(self) -> str:
        return self.__dict__["path"]

    @property
    def offset(self) -> int:
        return self.__dict__["offset"]

    def read_into(self, out: np.ndarray) -> np.ndarray:
        raw = out.reshape(-1).view(np.uint8).data
        with open(self.path, "rb", buffering=0) as handle:
            handle.seek(self.offset)
            while raw:
                done = handle.readinto(raw)
                if not done:
                    raise TensorFileError(f"{self.path} ends inside a tensor (truncated?)")
                raw = raw[done:]
        return out

    def read_bytes(self, start: int, count: int) -> bytes:
        """`count` raw bytes of the values from byte `start` (a chunk to send, a block of rows), read, not mapped:
        a window of a tensor larger than memory, which leaves nothing resident behind it."""
        _check_window(start, count, self.nbytes)
        with open(self.path, "rb", buffering=0) as handle:
            data = os.pread(handle.fileno(), count, self.offset + start)
        if len(data) != count:
            raise TensorFileError(f"{self.path} ends inside a tensor (truncated?)")
        return data

    def view(self) -> np.ndarray:
        if not self.nbytes:  # mmap cannot map nothing
            return super().view()
        return np.memmap(self.path, self.dtype, "r", offset=self.offset, shape=self.shape)


def as_record(arrays: Mapping[str, Array]) -> ArrayRecord:
    """An ArrayRecord holding these very Arrays (`ArrayRecord(dict)` would copy each into a plain Array)."""
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


def layout_of(tensors: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The layout of named numpy arrays, torch tensors or Flower Arrays."""
    return {name: (_dtype_name(value), tuple(value.shape)) for name, value in tensors.items()}


class TensorFileWriter:
    """A safetensors file of `layout`, filled tensor by tensor (`write`, in any order) and made durable by `close`.

    The file is created whole (sparse) at once, so a crash leaves a file that `close` never returned: callers
    commit by naming the file elsewhere (a checkpoint's JSON) only after `close`."""

    def __init__(
        self, path: str | Path, layout: Layout, metadata: Mapping[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self.layout = dict(layout)
        header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
        self._places: dict[str, tuple[int, int]] = {}
        end = 0
        for name, (dtype, shape) in self.layout.items():
            if dtype not in SAFETENSORS_DTYPES:
                raise TensorFileError(f"tensor {name!r}: dtype {dtype} has no safetensors form")
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
            header[name] = {
                "dtype": SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [end, end + nbytes],
            }
            self._places[name] = (end, nbytes)
            end += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (
            -len(encoded) % 8
        )  # the data starts 8-byte aligned, as safetensors writes it
        self._data_start = 8 + len(encoded)
        self._written: set[str] = {name for name, (_, nbytes) in self._places.items() if not nbytes}
        self._filled: dict[str, int] = {}
        self._descriptor = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(self._descriptor, struct.pack("<Q", len(encoded)) + encoded)
            os.ftruncate(self._descriptor, self._data_start + end)
        except BaseException:
            os.close(self._descriptor)
            raise

    def write(self, name: str, values: np.ndarray | torch.Tensor | Array) -> None:
        """Write tensor `name`; its dtype and shape must be the layout's."""
        if name not in self._places:
            raise TensorFileError(f"{self.path.name} has no tensor {name!r} in its layout")
        array = _numpy(values)
        dtype, shape = self.layout[name]
        if str(array.dtype) != dtype or tuple(array.shape) != tuple(shape):
            raise TensorFileError(
                f"tensor {name!r} is {array.dtype}{tuple(array.shape)}, the layout says {dtype}{tuple(shape)}"
            )
        start, nbytes = self._places[name]
        self._pwrite(_raw(array), self._data_start + start)
        self._written.add(name)

    def write_at(self, name: str, start: int, data: bytes | memoryview | np.ndarray) -> None:
        """Raw bytes of tensor `name` at byte `start` of its values (a received chunk, a block of rows), so a
        tensor larger than memory is written a window at a time. The tensor counts as written once every one
        of its bytes has been given (each byte once: callers write disjoint pieces)."""
        if name not in self._places:
            raise TensorFileError(f"{self.path.name} has no tensor {name!r} in its layout")
        place, nbytes = self._places[name]
        raw = _raw(data)
        if start < 0 or start + len(raw) > nbytes:
            raise TensorFileError(
                f"tensor {name!r}: bytes {start}..{start + len(raw)} are outside its {nbytes} bytes"
            )
        written = len(raw)
        self._pwrite(raw, self._data_start + place + start)
        self._filled[name] = self._filled.get(name, 0) + written
        if self._filled[name] >= nbytes:
            self._written.add(name)

    def _pwrite(self, raw: memoryview, offset: int) -> None:
        """Write `raw` at `offset`, and start its writeback: `close`'s fsync then finds it mostly on disk,
        and the disk writes while the caller computes the next tensor."""
        start, nbytes = offset, len(raw)
        while raw:
            done = os.pwrite(self._descriptor, raw, offset)
            raw, offset = raw[done:], offset + done
        start_writeback(self._descriptor, start, nbytes)

    def close(self, *, durable: bool = True) -> dict[str, MappedArray]:
        """Every tensor written: flush to disk (unless not `durable`: a file read back by this process and
        removed, such as a site's exchange file) and give the file's tensors, mapped."""
        try:
            missing = [name for name in self.layout if name not in self._written]
            if missing:
                raise TensorFileError(f"{self.path.name}: tensor {missing[0]!r} was never written")
            if durable:
                os.fsync(self._descriptor)
        finally:
            os.close(self._descriptor)
            self._descriptor = -1
        return self.mapped()

    def discard(self) -> None:
        """Give the file up, written or not: it is removed (what mapped it must be done with it)."""
        if self._descriptor >= 0:
            os.close(self._descriptor)
            self._descriptor = -1
        self.path.unlink(missing_ok=True)

    def mapped(self) -> dict[str, MappedArray]:
        return {
            name: MappedArray(self.path, self._data_start + start, dtype, shape)
            for (name, (dtype, shape)), (start, _) in zip(
                self.layout.items(), self._places.values(), strict=True
            )
        }

    def __enter__(self) -> TensorFileWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None and self._descriptor >= 0:
            try:
                os.close(self._descriptor)
            except OSError:
                pass


class _Removal:
    """Held by every array of a file that goes when the last of them does (`removed_when_unused`)."""

    def __init__(self, path: Path) -> None:
        weakref.finalize(self, _unlink, path)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def removed_when_unused(arrays: Mapping[str, MappedArray]) -> dict[str, MappedArray]:
    """`arrays`, whose file is removed once none of them is referenced any more: a reply a site's app wrote to a
    file goes as soon as the site has sent it and let go of it, not at the app's next message (a model larger
    than memory would otherwise sit on the site's disk twice)."""
    removal = _Removal(Path(next(iter(arrays.values())).path)) if arrays else None
    for array in arrays.values():
        array.__dict__["removal"] = removal
    return dict(arrays)


def save_tensors(
    path: str | Path,
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    *,
    durable: bool = True,
) -> dict[str, MappedArray]:
    """Write `tensors` (numpy arrays, torch tensors, Flower Arrays, mapped ones among them) one at a time."""
    writer = TensorFileWriter(path, layout_of(tensors), metadata)
    for name, value in tensors.items():
        writer.write(name, value)
    return writer.close(durable=durable)


def open_tensors(path: str | Path) -> dict[str, MappedArray]:
    """The tensors of safetensors file `path`, mapped (their values are read when asked for)."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > _HEADER_LIMIT:
                raise TensorFileError(
                    f"{path} is not a safetensors file (header of {length} bytes)"
                )
            header = json.loads(handle.read(length))
        size = path.stat().st_size
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TensorFileError(f"{path} is not a readable safetensors file: {error}") from error
    header.pop("__metadata__", None)
    arrays = {}
    for name, entry in header.items():
        try:
            dtype = NUMPY_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise TensorFileError(
                f"{path}: tensor {name!r} has no readable entry ({error})"
            ) from None
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        if end - begin != nbytes or 8 + length + end > size or begin < 0:
            raise TensorFileError(f"{path}: tensor {name!r} does not fit the file")
        arrays[name] = MappedArray(path, 8 + length + begin, dtype, shape)
    return arrays


def _check_window(start: int, count: int, nbytes: int) -> None:
    if start < 0 or count < 0 or start + count > nbytes:
        raise TensorFileError(
            f"bytes {start}..{start + count} are outside the tensor's {nbytes} bytes"
        )


def _numpy(values: np.ndarray | torch.Tensor | Array) -> np.ndarray:
    if isinstance(values, OnDiskArray):
        return values.view()
    if isinstance(values, Array):
        return values.numpy()
    if isinstance(values, torch.Tensor):
        return values.detach().cpu().contiguous().numpy()
    return values


def _raw(data: bytes | memoryview | np.ndarray) -> memoryview:
    """Bytes to write: an array's values in C order, or the bytes themselves."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
    return memoryview(data).cast("B")


def _dtype_name(value: Any) -> str:
    if isinstance(value, Array):
        return str(value.dtype)
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return str(value.dtype)
