"""The codecs: named float tensors <-> the few packed arrays of `hydrafl.compression.layout`.

- bf16: each value rounded to bfloat16 (relative error <= 2^-8), sent as its 16 bits.
- int8: the tensors concatenated, cut into blocks of `block` values, each block sent as int8 with one float32
  scale (its largest |x| / 127): error <= scale / 2 per value.
- int4: the same with 4-bit values in -7..7 (scale = largest |x| / 7), two to a byte (value + 8, the first in the
  low nibble): about 7.8x fewer bytes than float32, where int8 stays just under 4x.
- topk: per tensor, the ceil(fraction x numel) values of largest |x| and their positions in the concatenation.
- powersgd: per matrix (a tensor of rank >= 2, viewed as rows x the rest) one power iteration from a warm-started
  Q (Vogels et al., 2019: P = M Q, orthogonalise P, Q = M^T P, send P and Q, M ~ P Q^T), with torch's own
  orthogonalisation from its DDP PowerSGD hook; exact on a matrix of rank <= r. Vectors travel whole.

Decoding always gives float32 tensors of the shapes the description declares; what is lost is the sender's to
keep (`hydrafl.compression.feedback`).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

from hydrafl.compression.layout import (
    PREFIX,
    CompressionError,
    Scheme,
    check_layout,
    check_values,
    index_dtype,
)

ORTHOGONALISATION_EPSILON = 1e-8
"""torch's PowerSGD default guard against an all-zero column (a zero update) in Gram-Schmidt."""


@dataclass(slots=True)
class Encoded:
    """One update in its wire form: the packed arrays and, for PowerSGD, each matrix's Q for the next warm start."""

    arrays: dict[str, np.ndarray]
    shapes: dict[str, tuple[int, ...]]
    warm: dict[str, torch.Tensor] = field(default_factory=dict)


def encode(
    tensors: Mapping[str, torch.Tensor],
    scheme: Scheme,
    warm: Mapping[str, torch.Tensor] | None = None,
) -> Encoded:
    """`tensors` packed as `scheme` sends them (in their order); `warm` holds last round's Q per matrix."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    flat = [t.detach().to("cpu", torch.float32).reshape(-1) for t in tensors.values()]
    total = torch.cat(flat) if flat else torch.zeros(0)
    if scheme.name == "bf16":
        return Encoded(
            {PREFIX + "bf16": total.to(torch.bfloat16).view(torch.int16).numpy()}, shapes
        )
    if scheme.name == "int8":
        quantised, scales = _quantise(total, scheme.block, 127)
        return Encoded(
            {PREFIX + "int8": quantised.numpy(), PREFIX + "scale": scales.numpy()}, shapes
        )
    if scheme.name == "int4":
        quantised, scales = _quantise(total, scheme.block, 7)
        return Encoded(
            {PREFIX + "int4": _pack_nibbles(quantised).numpy(), PREFIX + "scale": scales.numpy()},
            shapes,
        )
    if scheme.name == "topk":
        return Encoded(_topk(flat, scheme), shapes)
    if scheme.name == "powersgd":
        return _powersgd(tensors, scheme, warm or {})
    raise CompressionError("scheme none sends tensors as they are")


def decode(
    arrays: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, ...]],
    scheme: Scheme,
    *,
    exact: bool = False,
) -> dict[str, torch.Tensor]:
    """The float32 tensors `arrays` encode, each of its declared shape; raises CompressionError unless `arrays`
    are exactly the scheme's layout for `shapes` with values that decode to finite numbers. `exact`: the same bits
    on every machine (PowerSGD's P Q^T summed in a fixed order, not by the local BLAS), for a model that two ends
    rebuild and compare by hash (`hydrafl.compression.downloads`)."""
    check_layout(
        scheme, shapes, {name: (str(a.dtype), tuple(a.shape)) for name, a in arrays.items()}
    )
    total = sum(math.prod(shape) for shape in shapes.values())
    for name, values in arrays.items():
        check_values(name, values, total)
    parts = {
        name: torch.from_numpy(np.array(values)) for name, values in arrays.items()
    }  # writable copies
    if scheme.name == "bf16":
        flat = parts[PREFIX + "bf16"].view(torch.bfloat16).to(torch.float32)
    elif scheme.name == "int8":
        flat = _dequantise(parts[PREFIX + "int8"], parts[PREFIX + "scale"], scheme.block)
    elif scheme.name == "int4":
        flat = _dequantise(
            _unpack_nibbles(parts[PREFIX + "int4"], total), parts[PREFIX + "scale"], scheme.block
        )
    elif scheme.name == "topk":
        flat = torch.zeros(total, dtype=torch.float32)
        flat[parts[PREFIX + "index"].to(torch.int64)] = parts[PREFIX + "value"]
    else:
        return _unpack_powersgd(parts, shapes, scheme, exact)
    if not torch.isfinite(flat).all():
        raise CompressionError("the update decodes to NaN or Inf")
    return _split(flat, shapes)


def _split(flat: torch.Tensor, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, shape in shapes.items():
        size = math.prod(shape)
        out[name] = flat[offset : offset + size].reshape(shape)
        offset += size
    return out


def _quantise(total: torch.Tensor, block: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values [n] in -levels..levels and float32 scales [ceil(n / block)], scale = max |x| / levels over
    each block."""
    n = total.numel()
    blocks = torch.nn.functional.pad(total, (0, -n % block)).reshape(-1, block)  # [n_blocks, block]
    scales = blocks.abs().amax(dim=1) / levels
    quantised = torch.round(
        blocks / scales.clamp(min=torch.finfo(torch.float32).tiny)[:, None]
    ).clamp_(-levels, levels)
    return quantised.to(torch.int8).reshape(-1)[:n], scales


def _pack_nibbles(quantised: torch.Tensor) -> torch.Tensor:
    """Values in -7..7 as uint8 pairs: value + 8 in each nibble, the first of a pair low; an odd tail pads with 0."""
    biased = torch.nn.functional.pad(
        quantised.to(torch.uint8) + 8, (0, quantised.numel() % 2), value=8
    )
    pairs = biased.reshape(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The n int8 values `_pack_nibbles` packed (a nibble of 0, which it never writes, reads as -8)."""
    low, high = (packed & 0x0F).to(torch.int8) - 8, (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=1).reshape(-1)[:n]


def _dequantise(quantised: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    n = quantised.numel()
    padded = torch.nn.functional.pad(quantised.to(torch.float32), (0, -n % block)).reshape(
        -1, block
    )
    return (padded * scales[:, None]).reshape(-1)[:n]


def _topk(flat: list[torch.Tensor], scheme: Scheme) -> dict[str, np.ndarray]:
    """Per tensor its k largest |x| (numpy's partition: a few times faster than torch.topk on a CPU), as
    positions in the concatenation and their values."""
    indices, values, offset = [], [], 0
    for tensor in flat:
        n, k = tensor.numel(), scheme.topk_count(tensor.numel())
        chosen = (
            torch.from_numpy(np.argpartition(tensor.abs().numpy(), n - k)[n - k :])
            if k
            else torch.zeros(0, dtype=torch.int64)
        )
        indices.append(chosen + offset)
        values.append(tensor[chosen])
        offset += tensor.numel()
    index = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int64)
    value = torch.cat(values) if values else torch.zeros(0)
    return {
        PREFIX + "index": index.numpy().astype(index_dtype(offset)),
        PREFIX + "value": value.numpy(),
    }


def _powersgd(
    tensors: Mapping[str, torch.Tensor], scheme: Scheme, warm: Mapping[str, torch.Tensor]
) -> Encoded:
    ps, qs, whole, new_warm = [], [], [], {}
    for name, tensor in tensors.items():
        shape = scheme.factorised(tuple(tensor.shape))
        values = tensor.detach().to("cpu", torch.float32)
        if shape is None:
            whole.append(values.reshape(-1))
            continue
        rows, columns, rank = shape
        matrix = values.reshape(rows, columns)
        q = warm.get(name)
        if q is None or tuple(q.shape) != (columns, rank):
            q = _initial_q(name, columns, rank)
        p = matrix @ q  # [rows, rank]
        _orthogonalize(
            p.unsqueeze(0), epsilon=ORTHOGONALISATION_EPSILON
        )  # in place, through the view
        q = matrix.T @ p  # [columns, rank]
        ps.append(p.reshape(-1))
        qs.append(q.reshape(-1))
        new_warm[name] = q
    arrays = {
        PREFIX + name: (torch.cat(parts) if parts else torch.zeros(0)).numpy()
        for name, parts in (("p", ps), ("q", qs), ("raw", whole))
    }
    return Encoded(arrays, {name: tuple(t.shape) for name, t in tensors.items()}, new_warm)


def _initial_q(name: str, columns: int, rank: int) -> torch.Tensor:
    """A seeded random start (the same for a name on every site and run), as torch's hook draws it."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(columns, rank, generator=generator)


def _exact_product(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P Q^T [rows, columns] as float64 rank-one terms added in order: each float32 product is exact in float64
    and elementwise sums round the same everywhere, where a BLAS matmul's order and FMA use vary by machine."""
    p64, q64 = p.to(torch.float64), q.to(torch.float64)
    out = torch.zeros(p.shape[0], q.shape[0], dtype=torch.float64)
    for k in range(p.shape[1]):
        out += p64[:, k, None] * q64[None, :, k]
    return out.to(torch.float32)


def _unpack_powersgd(
    parts: Mapping[str, torch.Tensor],
    shapes: Mapping[str, tuple[int, ...]],
    scheme: Scheme,
    exact: bool,
) -> dict[str, torch.Tensor]:
    out, offsets = {}, {"p": 0, "q": 0, "raw": 0}

    def take(part: str, size: int) -> torch.Tensor:
        start = offsets[part]
        offsets[part] += size
        return parts[PREFIX + part][start : start + size]

    for name, shape in shapes.items():
        factored = scheme.factorised(shape)
        if factored is None:
            out[name] = take("raw", math.prod(shape)).reshape(shape)
            continue
        rows, columns, rank = factored
        p, q = (
            take("p", rows * rank).reshape(rows, rank),
            take("q", columns * rank).reshape(columns, rank),
        )
        out[name] = (_exact_product(p, q) if exact else p @ q.T).reshape(shape)
        if not torch.isfinite(out[name]).all():
            raise CompressionError(f"tensor {name!r} decodes to NaN or Inf")
    if not torch.isfinite(parts[PREFIX + "raw"]).all():
        raise CompressionError("the update decodes to NaN or Inf")
    return out
