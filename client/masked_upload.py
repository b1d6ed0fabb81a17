"""A site's masked vector made a window at a time: its update is clipped, quantised and masked window by window
(`ENCODE_WINDOW`), so the site holds its update as trained and the masked vector, never float64 copies or masks
of the whole; and the masked vector itself goes straight into a file of the site's exchange folder when it is
larger than the memory the site gives the exchange (`--exchange-memory-mb`), from which it is uploaded.

Each window is quantised with the random draws one call over the whole update makes, in the same order, so
without distributed DP (whose noise draws come window by window) the vector is the one `quantize.encode` and
`SiteSession.mask` make of the whole (the masks aside, which are new every round).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord

from hydrafl import protocol
from hydrafl.arrays import array_view
from hydrafl.client.exchange_folder import ExchangeFolder
from hydrafl.secagg import SecAggError, crypto
from hydrafl.secagg.field_sum import WINDOW_WORDS, windows
from hydrafl.secagg.noise import Encoding
from hydrafl.secagg.quantize import check_weights
from hydrafl.subnet.slices import Slice
from hydrafl.tensor_files import TensorFileWriter

ENCODE_WINDOW = WINDOW_WORDS // 4
"""Coordinates quantised at once (64 Ki): quantising holds about six float64 copies of a window, 3 MiB."""


def encoded_windows(
    delta: ArrayRecord, names: list[str], weight: int, encoding: Encoding
) -> Iterator[np.ndarray]:
    """`quantize.encode` of the update `delta` (its arrays `names`, flattened in that order) with one `weight`,
    as consecutive uint32 pieces: the weight, then the quantised update a window at a time."""
    weights = np.asarray([weight])
    check_weights(weights, encoding.params)
    factor = encoding.clip_factor(_float_windows(delta, names))
    yield weights.astype(np.uint32)
    for window in _float_windows(delta, names):
        yield encoding.quantised(window, weights, factor)


def expanded_windows(
    delta: ArrayRecord,
    slices: Mapping[str, Slice],
    shapes: Mapping[str, tuple[int, ...]],
    weight: int,
    encoding: Encoding,
) -> Iterator[np.ndarray]:
    """`encoded_windows` of a subnetwork's update: its compact `slices` of the arrays `shapes` (in that order)
    expanded to full shapes, with a weight per coordinate (`weight` on the slices, 0 off them), as pieces of
    the layout [every weight, the quantised values]; a tensor's full shape at a time, a window of it quantised
    at a time."""
    if set(delta) != set(slices) or not set(slices) <= set(shapes):
        raise SecAggError(
            "the update's arrays differ from the slices the round assigned: it cannot be summed securely"
        )
    check_weights(np.asarray([weight]), encoding.params)
    compact = (array_view(delta[name]).reshape(-1).astype(np.float64) for name in slices)
    factor = encoding.clip_factor(compact)  # the zeros off the slices add nothing to the norm
    for name, shape in shapes.items():
        yield _weights(slices, name, shape, weight).astype(np.uint32)
    for name, shape in shapes.items():
        values = _expand(delta, slices, name, shape)
        weights = _weights(slices, name, shape, weight)
        for start, count in windows(0, values.size, ENCODE_WINDOW):
            window = slice(start, start + count)
            yield encoding.quantised(values[window], weights[window], factor)


def _expand(
    delta: ArrayRecord, slices: Mapping[str, Slice], name: str, shape: tuple[int, ...]
) -> np.ndarray:
    """Tensor `name` at its full `shape`, flattened as float64: the site's slice values, 0 off them."""
    if name not in slices:
        return np.zeros(math.prod(shape))
    try:
        full = slices[name].put(
            torch.zeros(shape, dtype=torch.float64), torch.from_numpy(delta[name].numpy())
        )
    except (ValueError, IndexError, RuntimeError) as error:
        raise SecAggError(f"array {name!r} does not fit its assigned slice: {error}") from None
    return full.numpy().reshape(-1)


def _weights(
    slices: Mapping[str, Slice], name: str, shape: tuple[int, ...], weight: int
) -> np.ndarray:
    """Tensor `name`'s weight per coordinate, flattened: `weight` on its slice, 0 off it (and on a tensor the
    site did not train)."""
    if name not in slices:
        return np.zeros(math.prod(shape), np.int64)
    try:
        covered = slices[name].mask(shape)
    except (ValueError, IndexError, RuntimeError) as error:
        raise SecAggError(f"array {name!r} does not fit its assigned slice: {error}") from None
    return covered.numpy().reshape(-1).astype(np.int64) * weight


def masked_vector(
    pieces: Iterable[np.ndarray],
    length: int,
    masks: crypto.Masks,
    exchange: ExchangeFolder | None,
) -> Array:
    """The vector of `length` words `pieces` make, each piece masked where it lies (`crypto.apply_masks`): in a
    file of `exchange` when larger than its memory bound (a `MappedArray` the upload streams from), else in
    memory."""
    if exchange is None or 4 * length <= exchange.memory_bytes:
        out = np.empty(length, np.uint32)
        for offset, piece in _placed(pieces, length):
            out[offset : offset + piece.size] = crypto.apply_masks(piece, offset, masks)
        return Array(out)
    writer = TensorFileWriter(
        exchange.upload_path(), {protocol.SECAGG_MASKED: ("uint32", (length,))}
    )
    try:
        for offset, piece in _placed(pieces, length):
            masked = crypto.apply_masks(piece, offset, masks)
            writer.write_at(protocol.SECAGG_MASKED, 4 * offset, masked)
        return writer.close(durable=False)[protocol.SECAGG_MASKED]  # read back, then removed
    except BaseException:
        writer.discard()
        raise


def _placed(pieces: Iterable[np.ndarray], length: int) -> Iterator[tuple[int, np.ndarray]]:
    """(offset, piece) of `pieces` laid end to end; SecAggError unless they fill `length` words exactly."""
    offset = 0
    for piece in pieces:
        if offset + piece.size > length:
            raise SecAggError(f"the encoded vector is longer than the round's {length} elements")
        yield offset, piece
        offset += piece.size
    if offset != length:
        raise SecAggError(f"the encoded vector has {offset} elements, the round {length}")


def _float_windows(delta: ArrayRecord, names: list[str]) -> Iterator[np.ndarray]:
    """The update's values as float64, a window at a time, array after array."""
    for name in names:
        values = array_view(delta[name]).reshape(-1)
        for start, count in windows(0, values.size, ENCODE_WINDOW):
            yield values[start : start + count].astype(np.float64)
