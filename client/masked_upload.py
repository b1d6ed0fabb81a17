"""A site's masked vector made a window at a time: its update is clipped, quantised and masked window by window
(`ENCODE_WINDOW`), so the site holds its update as trained and the masked vector, never float64 copies or masks
of the whole; and the masked vector itself goes straight into a file of the site's exchange folder when it is
larger than the memory the site gives the exchange (`--exchange-memory-mb`), from which it is uploaded.

Each window is quantised with the random draws one call over the whole update makes, in the same order, so the
vector is the one `quantize.encode` and `SiteSession.mask` make of the whole (the masks aside, which are new
every round).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import numpy as np
from flwr.app import Array, ArrayRecord

from hydrafl import protocol
from hydrafl.arrays import array_view
from hydrafl.client.exchange_folder import ExchangeFolder
from hydrafl.secagg import SecAggError, SecAggParams, crypto
from hydrafl.secagg.field_sum import WINDOW_WORDS, windows
from hydrafl.secagg.noise import DistributedNoise, skellam
from hydrafl.secagg.quantize import check_weights, quantise
from hydrafl.tensor_files import TensorFileWriter

ENCODE_WINDOW = WINDOW_WORDS // 4
"""Coordinates quantised at once: quantising holds about six float64 copies of a window (2 MiB of words
here)."""


def encoded_windows(
    delta: ArrayRecord,
    names: list[str],
    weight: int,
    params: SecAggParams,
    rng: np.random.Generator,
    bound: float | None,
    noise: DistributedNoise | None = None,
) -> Iterator[np.ndarray]:
    """`quantize.encode` of the update `delta` (its arrays `names`, flattened in that order) with one `weight`,
    as consecutive uint32 pieces: the weight, then the quantised update a window at a time. `bound`: the update
    is first scaled down to that L2 norm when above it (`site_secagg.clip_norm`); `noise`: then clipped to its
    norm C and given the site's Skellam share on every coordinate (`DistributedNoise.encode`, weight 1). Both
    norms come from a first pass over the update."""
    weights = np.asarray([weight])
    check_weights(weights, params)
    factor = 1.0
    if bound or noise is not None:
        norm = math.sqrt(sum(float(np.dot(w, w)) for w in _float_windows(delta, names)))
        if not math.isfinite(norm):
            raise SecAggError("the update has NaN or infinite values")
        factor = bound / norm if bound and norm > bound else 1.0
        if noise is not None and norm * factor > noise.clip:
            factor *= noise.clip / (norm * factor)
    yield weights.astype(np.uint32)
    for window in _float_windows(delta, names):
        if not np.all(np.isfinite(window)):
            raise SecAggError("the update has NaN or infinite values")
        piece = quantise(window * factor if factor != 1.0 else window, weights, params, rng)
        if noise is not None:  # two's complement: mod 2^32
            piece += skellam(rng, noise.site_variance(), piece.size).astype(np.uint32)
        yield piece


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
