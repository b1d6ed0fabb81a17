"""A checkpoint's values without pickle: every tensor goes to a flat table (written as safetensors), everything
else to JSON that names its tensors, so reading a checkpoint back runs no code and gives the same values bit
for bit (types included: a tuple stays a tuple, an int key an int, a float32 scalar a float32).

What encodes: None, bool, int, float (NaN and infinities too), str; list, tuple, dict (any encodable keys);
torch tensors, numpy arrays and scalars, Flower ArrayRecords; and the dataclasses strategies keep in their state
(`DATACLASSES`), by their fields. Anything else is a `StateCodecError` naming where it was: never dropped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from hydrafl.strategies.planner import SiteScores
from hydrafl.subnet.planning import LayerCost, RankCost
from hydrafl.subnet.slices import Slice
from hydrafl.subnet.spec import SubnetSpec
from hydrafl.tensor_files import MappedArray, OnDiskArray

DATACLASSES: Mapping[str, type] = {
    cls.__name__: cls for cls in (SiteScores, LayerCost, RankCost, SubnetSpec, Slice)
}
"""The objects a strategy's state may hold besides plain values and tensors: rebuilt from their fields."""
_PLAIN = (type(None), bool, int, str)
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class StateCodecError(ValueError):
    """A value with no checkpoint form, or a checkpoint whose JSON does not decode."""


class Encoder:
    """Encodes values to JSON-ready form, collecting their tensors in `tensors` (name -> tensor). A tensor kept
    in a file of `folder` (a model larger than memory, `MappedArray`) is not copied: the JSON names its file and
    place, and `files` lists the files so named."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder
        self.files: set[str] = set()
        self.tensors: dict[str, torch.Tensor] = {}
        self._stored: set[int] = set()
        self._names: dict[int, str] = {}
        self._held: list[Any] = []  # what `_names` knows by id stays alive while encoding

    def encode(self, value: Any, where: str) -> Any:
        """`value` in JSON form; `where` names it (e.g. `strategy_state['m_t']`) in errors and tensor names."""
        kind = type(value)
        if kind in _PLAIN:
            return value
        if kind is float:
            return value if math.isfinite(value) else {"$float": repr(value)}
        if kind is list:
            return [self.encode(item, f"{where}[{i}]") for i, item in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.encode(item, f"{where}[{i}]") for i, item in enumerate(value)]}
        if kind is dict:
            return self._dict(value, where)
        if isinstance(value, torch.Tensor):
            return {"$tensor": self._tensor(value, lambda: value, where)}
        if isinstance(value, np.ndarray):
            return {"$ndarray": self._tensor(value, lambda: _torch(value, where), where)}
        if isinstance(value, np.generic) and value.dtype.kind in "biuf":
            return {"$scalar": [value.dtype.str, self.encode(value.item(), where)]}
        if isinstance(value, OnDiskArray):
            return self._on_disk(value, where)
        if isinstance(value, ArrayRecord):
            return {
                "$arrays": [
                    [name, self._array(array, f"{where}[{name!r}]")]
                    for name, array in value.items()
                ]
            }
        if DATACLASSES.get(kind.__name__) is kind:
            fields = {
                f.name: self.encode(getattr(value, f.name), f"{where}.{f.name}")
                for f in dataclasses.fields(value)
                if f.init
            }
            return {"$object": [kind.__name__, fields]}
        raise StateCodecError(
            f"{where} is a {kind.__module__}.{kind.__qualname__}, which has no checkpoint form (plain values, "
            "tensors, ArrayRecords and the dataclasses in hydrafl.server.aggregation.state_codec.DATACLASSES)"
        )

    def _dict(self, value: dict, where: str) -> Any:
        if all(type(k) is str and not k.startswith("$") for k in value):
            return {k: self.encode(v, f"{where}[{k!r}]") for k, v in value.items()}
        return {
            "$items": [
                [self.encode(k, f"{where} key {k!r}"), self.encode(v, f"{where}[{k!r}]")]
                for k, v in value.items()
            ]
        }

    def _array(self, array: Array, where: str) -> str | dict[str, Any]:
        if isinstance(array, OnDiskArray):
            return self._on_disk(array, where)
        return self._tensor(array, lambda: _torch(array.numpy(), where), where)

    def _on_disk(self, array: OnDiskArray, where: str) -> dict[str, Any]:
        """A reference to the array's place in a file of `folder`; an array elsewhere is copied in."""
        if (
            not isinstance(array, MappedArray)
            or self.folder is None
            or Path(array.path).parent != self.folder
        ):
            return {"$ndarray": self._tensor(array, lambda: _torch(array.numpy(), where), where)}
        path = Path(array.path)
        self.files.add(path.name)
        return {"$file": [path.name, array.offset, array.dtype, list(array.shape)]}

    def _tensor(self, source: Any, convert: Callable[[], torch.Tensor], where: str) -> str:
        """The name of `source`'s tensor (`convert()`), stored once however often the state refers to it (the
        global arrays are also DiLoCo's `current_arrays`)."""
        if id(source) in self._names:
            return self._names[id(source)]
        name = where if where not in self.tensors else f"{where}#{len(self.tensors)}"
        self._names[id(source)] = name
        self._held.append(source)
        tensor = convert().detach().cpu().contiguous()
        whole = tensor.storage_offset() == 0 and (
            tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        )
        if not whole or tensor.data_ptr() in self._stored:
            tensor = tensor.clone()  # safetensors stores dense storage that no other tensor shares
        self._stored.add(tensor.data_ptr())
        self.tensors[name] = tensor
        return name


def _torch(array: np.ndarray, where: str) -> torch.Tensor:
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = array.copy(order="C")  # torch shares writable, dense memory only
    try:
        return torch.from_numpy(array)
    except TypeError as error:
        raise StateCodecError(
            f"{where}: a numpy array of {array.dtype} has no checkpoint form"
        ) from error


def decode(value: Any, tensors: Mapping[str, torch.Tensor], folder: Path | None = None) -> Any:
    """The value `Encoder.encode` gave `value`, its tensors read from `tensors`, its references to files from
    `folder` (mapped, not read)."""
    return _Decoder(tensors, folder).decode(value)


class _Decoder:
    def __init__(self, tensors: Mapping[str, torch.Tensor], folder: Path | None) -> None:
        self.tensors = tensors
        self.folder = folder
        self.arrays: dict[str, Array] = {}
        """Each stored tensor's Flower Array, made once: ArrayRecords that shared arrays share them again."""

    def decode(self, value: Any) -> Any:
        if isinstance(value, list):
            return [self.decode(item) for item in value]
        if not isinstance(value, dict):
            return value
        tag = next(iter(value), None)
        if len(value) != 1 or not isinstance(tag, str) or not tag.startswith("$"):
            return {k: self.decode(v) for k, v in value.items()}
        body = value[tag]
        if tag == "$tuple":
            return tuple(self.decode(item) for item in body)
        if tag == "$items":
            return {self.decode(k): self.decode(v) for k, v in body}
        if tag == "$float":
            return _NON_FINITE[body]
        if tag == "$tensor":
            return self.stored(body)
        if tag == "$ndarray":
            return self.stored(body).numpy()
        if tag == "$file":
            return self.on_disk(body)
        if tag == "$scalar":
            return np.dtype(body[0]).type(self.decode(body[1]))
        if tag == "$arrays":
            return ArrayRecord({name: self.array(key) for name, key in body})
        if tag == "$object" and body[0] in DATACLASSES:
            return DATACLASSES[body[0]](**{k: self.decode(v) for k, v in body[1].items()})
        raise StateCodecError(f"unknown checkpoint tag {tag} ({str(body)[:80]})")

    def stored(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise StateCodecError(f"the checkpoint's tensors lack {name!r}")
        return self.tensors[name]

    def on_disk(self, body: list) -> MappedArray:
        if self.folder is None:
            raise StateCodecError("a checkpoint that refers to tensor files needs their folder")
        file, offset, dtype, shape = body
        if Path(file).name != file:
            raise StateCodecError(
                f"a checkpoint's tensor file must be in its own folder, not {file!r}"
            )
        return MappedArray(self.folder / file, int(offset), str(dtype), tuple(shape))

    def array(self, name: str | dict) -> Array:
        if isinstance(name, dict):
            return self.on_disk(name["$file"])
        if name not in self.arrays:
            self.arrays[name] = Array(self.stored(name).numpy())
        return self.arrays[name]


def without_code(value: Any) -> Any:
    """`value` with the callables in its dicts left out: what an old pickled state of Flower's strategies held
    besides data (its aggregation functions), which the strategy built for the resume has already."""
    if type(value) is dict:
        return {k: without_code(v) for k, v in value.items() if not callable(v)}
    return value
