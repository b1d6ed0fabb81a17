"""A site's masked vector made a window at a time (`masked_upload`): the same encoded values as one `encode` of
the whole update, the same masked vector as `SiteSession.mask`, written into an upload file of the exchange
folder when larger than its memory bound (removed after the push), and a window of memory either way."""

from __future__ import annotations

import tracemalloc
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import make_reply
from secagg_rounds import started

from hydrafl import protocol
from hydrafl.client.exchange_folder import ExchangeFolder
from hydrafl.client.masked_upload import encoded_windows, expanded_windows, masked_vector
from hydrafl.secagg import SecAggError, SecAggParams, crypto, encode
from hydrafl.secagg.field_sum import WINDOW_WORDS
from hydrafl.secagg.noise import DistributedNoise, Encoding
from hydrafl.tensor_files import MappedArray, as_record

PARAMS = SecAggParams()


def _update(seed: int, shapes: dict[str, tuple[int, ...]]) -> ArrayRecord:
    rng = np.random.default_rng(seed)
    return ArrayRecord(
        {
            name: Array(rng.normal(0, 0.01, shape).astype(np.float32))
            for name, shape in shapes.items()
        }
    )


def _flat(delta: ArrayRecord) -> np.ndarray:
    return np.concatenate([delta[name].numpy().astype(np.float64).ravel() for name in delta])


SHAPES = {"w": (700, 1000), "b": (123,), "h": (3, WINDOW_WORDS // 3 + 7)}
"""Arrays across window boundaries, one shorter than a window."""


def test_an_update_encoded_a_window_at_a_time_is_the_one_encode_of_the_whole():
    delta = _update(0, SHAPES)
    pieces = list(
        encoded_windows(delta, list(SHAPES), 37, Encoding(PARAMS, np.random.default_rng(5)))
    )
    assert len(pieces) > 3 and pieces[0].tolist() == [37]
    whole = encode(_flat(delta), 37, PARAMS, np.random.default_rng(5))
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    bound = float(np.linalg.norm(_flat(delta))) / 4  # the honest-site bound clips it
    clipped = np.concatenate(
        list(
            encoded_windows(
                delta, list(SHAPES), 37, Encoding(PARAMS, np.random.default_rng(5), bound)
            )
        )
    )
    expected = encode(
        _flat(delta) * (bound / np.linalg.norm(_flat(delta))), 37, PARAMS, np.random.default_rng(5)
    )
    difference = np.abs(clipped.astype(np.int64) - expected)  # the norm summed window by window
    assert difference.max() <= 1 and (difference == 0).mean() > 0.999
    assert not np.array_equal(clipped[1:], whole[1:])
    delta["b"] = Array(np.full(123, np.nan, np.float32))
    with pytest.raises(SecAggError, match="NaN"):
        list(encoded_windows(delta, list(SHAPES), 37, Encoding(PARAMS, np.random.default_rng(5))))
    with pytest.raises(SecAggError, match="max_weight"):
        list(
            encoded_windows(delta, list(SHAPES), 10**6, Encoding(PARAMS, np.random.default_rng(5)))
        )


@pytest.mark.parametrize("memory_bytes", [1 << 30, 0])
def test_a_masked_vector_made_a_window_at_a_time_is_the_whole_ones(tmp_path, memory_bytes):
    """In memory (under the exchange's bound) or in an upload file of the exchange folder (over it, which the
    push removes afterwards: `spill` names it), the encoded vector plus each mask of the whole vector."""
    delta = _update(1, SHAPES)
    length = 1 + sum(int(np.prod(shape)) for shape in SHAPES.values())
    pieces = list(
        encoded_windows(delta, list(SHAPES), 5, Encoding(PARAMS, np.random.default_rng(0)))
    )
    server, sites = started([1, 2, 3], PARAMS, length)
    masks = sites[1].masks(server.shares_for(1))
    assert len(masks) == 3 and [added for _, added in masks] == [True, True, True]  # self, 2, 3
    exchange = ExchangeFolder(memory_bytes, tmp_path)
    masked = masked_vector(iter([piece.copy() for piece in pieces]), length, masks, exchange)
    reference = np.concatenate(pieces)
    for seed, _ in masks:
        reference = reference + crypto.mask(seed, length)
    np.testing.assert_array_equal(masked.numpy(), reference)
    uploads = list(tmp_path.glob("upload-*.safetensors"))
    if memory_bytes:
        assert not isinstance(masked, MappedArray) and uploads == []
        return
    assert isinstance(masked, MappedArray) and uploads == [Path(masked.path)]
    reply = make_reply({}, 1.0)
    reply.content["arrays"] = as_record({protocol.SECAGG_MASKED: masked})
    assert exchange.spill(reply) == uploads[0]  # the push removes it afterwards
    with pytest.raises(SecAggError, match="longer than the round's"):
        masked_vector(iter([*pieces, pieces[0]]), length, masks, exchange)
    assert list(tmp_path.glob("upload-*.safetensors")) == uploads  # the failed one is gone


def test_a_site_masks_a_32_mb_update_into_its_exchange_file_in_a_window_of_a_few_mb(tmp_path):
    shapes = {"w": (2048, 4096)}  # 8M coordinates
    delta = _update(2, shapes)
    length = 1 + 2048 * 4096
    server, sites = started([1, 2, 3], PARAMS, length)
    masks = sites[1].masks(server.shares_for(1))
    rng = np.random.default_rng(0)
    tracemalloc.start()
    pieces = encoded_windows(delta, list(shapes), 5, Encoding(PARAMS, rng, 1.0))
    masked = masked_vector(pieces, length, masks, ExchangeFolder(0, tmp_path))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # windows of quantising (float64) and masking, not the 32 MB vector (nor the 64 MB float64 update)
    assert isinstance(masked, MappedArray) and peak < 4 * length / 8, f"{peak / 2**20:.1f} MiB"


def test_distributed_dp_a_window_at_a_time_clips_to_c_and_adds_the_sites_skellam_share():
    """With z = 0 the one `DistributedNoise.encode` of the whole, bit for bit (the clip to C is the mechanism's);
    with z > 0, each coordinate of a zero update carries Skellam noise of the site's variance."""
    params = SecAggParams(dp_clip=0.01, dp_noise_multiplier=0.0, max_weight=1)
    delta = _update(3, SHAPES)
    size = sum(int(np.prod(shape)) for shape in SHAPES.values())
    noise = DistributedNoise.of(params, size, 3)
    pieces = encoded_windows(
        delta, list(SHAPES), 1, Encoding(params, np.random.default_rng(7), None, noise)
    )
    whole = noise.encode(_flat(delta), params, np.random.default_rng(7), 1)
    np.testing.assert_array_equal(np.concatenate(list(pieces)), whole)
    noised = replace(params, dp_noise_multiplier=1.0)
    noise = DistributedNoise.of(noised, size, 3)
    zero = ArrayRecord({name: Array(np.zeros(shape, np.float32)) for name, shape in SHAPES.items()})
    rng = np.random.default_rng(8)
    encoded = np.concatenate(
        list(encoded_windows(zero, list(SHAPES), 1, Encoding(noised, rng, None, noise)))
    )
    draws = (encoded[1:] - np.uint32(noised.quantization_range // 2)).view(np.int32)
    variance = noise.site_variance()
    assert variance > 1 and abs(draws.mean()) < 5 * np.sqrt(variance / size)
    assert abs(draws.var() / variance - 1) < 0.02


def test_a_subnetworks_slices_expanded_a_tensor_at_a_time_are_the_one_encode_of_the_full_shapes():
    """The layout [a weight per coordinate, the quantised values]: `weight` on the slices, 0 off them and on
    arrays the site did not train, each tensor expanded to its full shape in turn."""
    import torch

    from hydrafl.subnet.slices import Slice

    shapes = {"a": (6, 5), "b": (300, 1000), "c": (4,)}
    slices = {"a": Slice(0, torch.tensor([1, 4])), "b": Slice(1, torch.arange(0, 1000, 3))}
    delta = _update(4, {"a": (2, 5), "b": (300, 334)})
    pieces = expanded_windows(delta, slices, shapes, 7, Encoding(PARAMS, np.random.default_rng(9)))
    full = {name: np.zeros(shape) for name, shape in shapes.items()}
    covered = {name: np.zeros(shape, np.int64) for name, shape in shapes.items()}
    full["a"][[1, 4]] = delta["a"].numpy()
    covered["a"][[1, 4]] = 7
    full["b"][:, ::3] = delta["b"].numpy()
    covered["b"][:, ::3] = 7
    flat = np.concatenate([values.ravel() for values in full.values()])
    weights = np.concatenate([values.ravel() for values in covered.values()])
    expected = encode(flat, weights, PARAMS, np.random.default_rng(9))
    np.testing.assert_array_equal(np.concatenate(list(pieces)), expected)
    for wrong, why in [
        ({"a": slices["a"]}, "differ from the slices"),
        ({"a": slices["b"], "b": slices["b"]}, "'a' does not fit its assigned slice"),
    ]:
        with pytest.raises(SecAggError, match=why):
            list(
                expanded_windows(
                    delta, wrong, shapes, 7, Encoding(PARAMS, np.random.default_rng(9))
                )
            )
