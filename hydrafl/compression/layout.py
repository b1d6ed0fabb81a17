"""What a compressed update looks like on the wire, computed from the scheme and the tensors' shapes alone.

A compressed reply packs all its tensors into a few arrays (one per part of the scheme, e.g. `compress.int8` and
`compress.scale`: a few npy headers and manifest entries instead of one per tensor) plus a ConfigRecord
(`RECORD`) naming the tensors and their shapes in order. The receiver takes the scheme from what it sent, never
from the reply, so the exact dtype and shape of every array is known before any byte is read
(`expected_arrays`); the edge check and the decoder both hold a reply to it. Torch-free: the coordinator's
edge check imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

SCHEMES = ("none", "bf16", "int8", "int4", "topk", "powersgd")
RECORD = "compress"
"""The ConfigRecord of a compressed reply: `scheme`, `names`, `ranks` and `dims` (the shapes, flattened)."""
PREFIX = "compress."
"""Every array of a compressed reply is named PREFIX + part."""
DOWNLOAD_RECORD = "download"
"""The ConfigRecord of a train or evaluate message under `--compress-downloads` (`hydrafl.compression.downloads`):
`mode` (full or delta), the `base` and `target` digests of the site's reference model and, for a delta, the
tensors' `names`, `ranks` and `dims` as in `RECORD`."""
MAX_RANK = 8
MAX_DIMENSION = 1 << 40


class CompressionError(ValueError):
    """A compressed update that does not match its scheme (or a scheme that is not one); says what differs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scheme:
    """How updates are compressed; the same settings at both ends (they travel in the run config)."""

    name: str = "none"
    """none, bf16, int8 or int4 (per-block scales), topk (sparsification) or powersgd (low-rank factors of
    matrices)."""
    topk_fraction: float = 0.05
    """topk: the fraction of each tensor's coordinates sent (at least one)."""
    rank: int = 4
    """powersgd: the rank of each matrix's factors."""
    block: int = 256
    """int8, int4: coordinates per scale."""

    def __post_init__(self) -> None:
        if self.name not in SCHEMES:
            raise CompressionError(
                f"compress {self.name!r} is not a scheme; choose one of {', '.join(SCHEMES)}"
            )
        if not 0 < self.topk_fraction <= 0.5:
            raise CompressionError(
                f"compress-topk-fraction must be in (0, 0.5], got {self.topk_fraction!r}"
            )
        if not 1 <= self.rank <= 1024:
            raise CompressionError(f"compress-rank must be in 1..1024, got {self.rank!r}")
        if not 8 <= self.block <= 1 << 20:
            raise CompressionError(f"compress-block must be in 8..2^20, got {self.block!r}")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Scheme:
        """The scheme a run config names (kebab-case keys, as `RunConfig.to_flower` writes them)."""
        try:
            return cls(
                name=str(config.get("compress", "none")),
                topk_fraction=float(config.get("compress-topk-fraction", 0.05)),
                rank=int(config.get("compress-rank", 4)),
                block=int(config.get("compress-block", 256)),
            )
        except (TypeError, ValueError) as error:
            raise CompressionError(str(error)) from None

    def to_config(self) -> dict[str, str | int | float]:
        """The scheme's keys as `from_config` reads them: what a message says about the form of its reply
        (the coordinator's edge holds a compressed reply to the message it answers, never to the reply's say)."""
        return {
            "compress": self.name,
            "compress-topk-fraction": self.topk_fraction,
            "compress-rank": self.rank,
            "compress-block": self.block,
        }

    def factorised(self, shape: Sequence[int]) -> tuple[int, int, int] | None:
        """powersgd: (rows, columns, rank) of the matrix a tensor is sent as, or None when it goes whole (a
        vector, or a matrix whose factors would not be smaller)."""
        if self.name != "powersgd" or len(shape) < 2:
            return None
        rows, columns = shape[0], math.prod(shape[1:])
        rank = min(self.rank, rows, columns)
        return (rows, columns, rank) if rank and rank * (rows + columns) < rows * columns else None

    def topk_count(self, numel: int) -> int:
        """topk: how many of a tensor's `numel` coordinates are sent."""
        return min(numel, max(1, math.ceil(self.topk_fraction * numel))) if numel else 0


def expected_arrays(
    scheme: Scheme, shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Name -> (dtype, shape) of every array the compressed form of `shapes` (in order) consists of."""
    total = sum(math.prod(shape) for shape in shapes.values())
    if scheme.name == "bf16":
        return {PREFIX + "bf16": ("int16", (total,))}  # the bfloat16 bits: numpy has no bfloat16
    if scheme.name in ("int8", "int4"):
        scales = (PREFIX + "scale", ("float32", (math.ceil(total / scheme.block),)))
        if scheme.name == "int4":  # two values a byte
            return dict([(PREFIX + "int4", ("uint8", (math.ceil(total / 2),))), scales])
        return dict([(PREFIX + "int8", ("int8", (total,))), scales])
    if scheme.name == "topk":
        kept = sum(scheme.topk_count(math.prod(shape)) for shape in shapes.values())
        return {
            PREFIX + "index": (index_dtype(total), (kept,)),
            PREFIX + "value": ("float32", (kept,)),
        }
    if scheme.name == "powersgd":
        factors = [f for f in map(scheme.factorised, shapes.values()) if f is not None]
        whole = sum(
            math.prod(shape) for shape in shapes.values() if scheme.factorised(shape) is None
        )
        return {
            PREFIX + "p": ("float32", (sum(rows * rank for rows, _, rank in factors),)),
            PREFIX + "q": ("float32", (sum(columns * rank for _, columns, rank in factors),)),
            PREFIX + "raw": ("float32", (whole,)),
        }
    raise CompressionError("scheme none sends tensors as they are")


def index_dtype(total: int) -> str:
    return "int32" if total < 2**31 else "int64"


def describe(scheme: Scheme, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """The reply's RECORD: the scheme's name and each tensor's name and shape, in packing order."""
    return {
        "scheme": scheme.name,
        "names": list(shapes),
        "ranks": [len(shape) for shape in shapes.values()],
        "dims": [int(d) for shape in shapes.values() for d in shape],
    }


def read_description(scheme: Scheme, description: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The tensors' shapes a reply's RECORD declares, checked: the receiver's scheme, distinct names, real shapes."""
    if set(description) != {"scheme", "names", "ranks", "dims"}:
        raise CompressionError(
            f"record {RECORD!r} holds {sorted(description)}, not scheme, names, ranks, dims"
        )
    if description["scheme"] != scheme.name:
        raise CompressionError(
            f"the reply is compressed with {description['scheme']!r}; this run uses {scheme.name!r}"
        )
    names, ranks, dims = description["names"], description["ranks"], description["dims"]
    if not all(isinstance(v, list) for v in (names, ranks, dims)) or len(names) != len(ranks):
        raise CompressionError("names and ranks must be lists of equal length")
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise CompressionError("tensor names must be distinct non-empty strings")
    if not all(isinstance(r, int) and 0 <= r <= MAX_RANK for r in ranks) or sum(ranks) != len(dims):
        raise CompressionError(f"ranks must be in 0..{MAX_RANK} and add up to the {len(dims)} dims")
    if not all(isinstance(d, int) and 0 <= d <= MAX_DIMENSION for d in dims):
        raise CompressionError("dims must be integers in 0..2^40")
    shapes, offset = {}, 0
    for name, rank in zip(names, ranks, strict=True):
        shapes[name] = tuple(dims[offset : offset + rank])
        offset += rank
    return shapes


def download_shapes(scheme: Scheme, download: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """The model tensors a delta download's `DOWNLOAD_RECORD` declares (all float32): what the message stands for,
    and what a reply to it may carry, where its arrays are the compressed change."""
    return read_description(
        scheme, {key: download.get(key) for key in ("scheme", "names", "ranks", "dims")}
    )


def check_layout(
    scheme: Scheme,
    shapes: Mapping[str, tuple[int, ...]],
    arrays: Mapping[str, tuple[str, tuple[int, ...]]],
) -> None:
    """`arrays` (name -> dtype, shape) must be exactly the scheme's arrays for `shapes`: nothing more or less."""
    expected = expected_arrays(scheme, shapes)
    if set(arrays) != set(expected):
        raise CompressionError(
            f"a {scheme.name} reply holds arrays {sorted(expected)}, not {sorted(arrays)}"
        )
    for name, (dtype, shape) in expected.items():
        if (arrays[name][0], tuple(arrays[name][1])) != (dtype, shape):
            raise CompressionError(
                f"array {name}: {arrays[name][0]} {list(arrays[name][1])}, expected {dtype} {list(shape)}"
            )


def check_values(name: str, values: np.ndarray, total: int) -> None:
    """Values that decode to finite numbers in place: bfloat16 bits with a finite exponent, indices inside the
    update's `total` coordinates (float parts are checked for NaN/Inf like any array)."""
    if name == PREFIX + "bf16" and ((values.view(np.uint16) & 0x7F80) == 0x7F80).any():
        raise CompressionError(f"array {name} contains NaN or Inf")
    if (
        name == PREFIX + "index"
        and values.size
        and not (0 <= values.min() and values.max() < total)
    ):
        raise CompressionError(
            f"array {name} has an index outside the update's {total} coordinates"
        )
