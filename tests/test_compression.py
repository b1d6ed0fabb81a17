"""Compressed updates: each codec's error bound by hand, the exact wire layout, error feedback (the decoded sum
tracks the true sum, persisted across a site restart), and runs with compression: close to uncompressed
accuracy, with the compressed bytes counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from helpers import SMALL_RUN, TIERED_RUN, make_reply

from hydrafl.arrays import from_record, to_record
from hydrafl.client import site_app
from hydrafl.compression.codecs import decode, encode
from hydrafl.compression.feedback import ErrorFeedback, compress_reply, coordinates_key
from hydrafl.compression.layout import RECORD, CompressionError, Scheme, expected_arrays
from hydrafl.compression.receive import decode_reply
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.validation import ConfigError


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"layer.weight": (48, 40), "layer.bias": (40,), "conv": (6, 5, 7), "scale": ()}
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def _round_trip(tensors: dict[str, torch.Tensor], scheme: Scheme) -> dict[str, torch.Tensor]:
    encoded = encode(tensors, scheme)
    assert {n: (str(a.dtype), a.shape) for n, a in encoded.arrays.items()} == expected_arrays(
        scheme, encoded.shapes
    )
    return decode(encoded.arrays, encoded.shapes, scheme)


def test_bf16_keeps_each_value_to_a_relative_error_of_two_to_the_minus_eight():
    tensors = _tensors()
    decoded = _round_trip(tensors, Scheme(name="bf16"))
    for name, tensor in tensors.items():
        assert decoded[name].dtype == torch.float32 and decoded[name].shape == tensor.shape
        assert ((decoded[name] - tensor).abs() <= tensor.abs() * 2**-8).all()


@pytest.mark.parametrize("block", [8, 64, 256])
@pytest.mark.parametrize(("name", "levels"), [("int8", 127), ("int4", 7)])
def test_quantisation_errs_by_at_most_half_a_step_of_its_block(name, levels, block):
    tensors = _tensors()
    scheme = Scheme(name=name, block=block)
    encoded = encode(tensors, scheme)
    decoded = decode(encoded.arrays, encoded.shapes, scheme)
    flat = torch.cat([t.reshape(-1) for t in tensors.values()])
    error = torch.cat([(decoded[n] - t).reshape(-1) for n, t in tensors.items()]).abs()
    scales = torch.from_numpy(encoded.arrays["compress.scale"]).repeat_interleave(block)[
        : flat.numel()
    ]
    assert (error <= scales / 2 * (1 + 1e-6)).all()
    assert len(encoded.arrays["compress.scale"]) == math.ceil(flat.numel() / block)
    for i, chunk in enumerate(flat.split(block)):
        assert encoded.arrays["compress.scale"][i] == pytest.approx(
            float(chunk.abs().max()) / levels
        )
    if name == "int4":  # two values a byte, whatever the parity of the count
        assert encoded.arrays["compress.int4"].dtype == np.uint8
        assert len(encoded.arrays["compress.int4"]) == math.ceil(flat.numel() / 2)
        sent = sum(a.nbytes for a in encoded.arrays.values())
        assert flat.numel() * 4 / sent > (7.5 if block == 256 else 2.5)


def test_topk_keeps_exactly_the_k_largest_magnitudes_of_each_tensor():
    tensors = _tensors()
    scheme = Scheme(name="topk", topk_fraction=0.1)
    decoded = _round_trip(tensors, scheme)
    for name, tensor in tensors.items():
        flat, kept = tensor.reshape(-1), decoded[name].reshape(-1)
        k = max(1, math.ceil(0.1 * flat.numel()))
        expected = set(torch.topk(flat.abs(), k).indices.tolist())
        assert set(torch.nonzero(kept).reshape(-1).tolist()) == expected
        assert torch.equal(kept[list(expected)], flat[list(expected)])


def test_powersgd_is_exact_on_a_matrix_of_its_rank_and_sends_vectors_whole():
    generator = torch.Generator().manual_seed(1)
    low_rank = torch.randn(60, 3, generator=generator) @ torch.randn(3, 50, generator=generator)
    tensors = {"w": low_rank, "b": torch.randn(50, generator=generator)}
    scheme = Scheme(name="powersgd", rank=3)
    encoded = encode(tensors, scheme)
    assert encoded.arrays["compress.p"].shape == (60 * 3,) and encoded.arrays[
        "compress.q"
    ].shape == (50 * 3,)
    decoded = decode(encoded.arrays, encoded.shapes, scheme)
    torch.testing.assert_close(decoded["w"], low_rank, atol=1e-4, rtol=1e-4)
    assert torch.equal(decoded["b"], tensors["b"])
    assert encoded.warm["w"].shape == (50, 3)  # the next round's warm start


def test_powersgd_sends_a_matrix_whole_when_its_factors_would_not_be_smaller():
    scheme = Scheme(name="powersgd", rank=4)
    assert scheme.factorised((6, 5)) is None and scheme.factorised((64, 32)) == (64, 32, 4)
    tensors = {"small": torch.randn(6, 5)}
    assert torch.equal(_round_trip(tensors, scheme)["small"], tensors["small"])


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "topk", "powersgd"])
def test_decoding_refuses_anything_but_the_exact_layout(name):
    scheme = Scheme(name=name)
    encoded = encode(_tensors(), scheme)
    part, array = next(iter(encoded.arrays.items()))
    with pytest.raises(CompressionError, match="expected"):
        decode({**encoded.arrays, part: array[:-1]}, encoded.shapes, scheme)
    with pytest.raises(CompressionError, match="not"):
        decode({**encoded.arrays, "compress.extra": array}, encoded.shapes, scheme)
    with pytest.raises(CompressionError):
        decode(encoded.arrays, encoded.shapes, Scheme(name="bf16" if name != "bf16" else "int8"))


def test_decoding_refuses_indices_outside_the_update_and_non_finite_values():
    scheme = Scheme(name="topk")
    encoded = encode(_tensors(), scheme)
    index = encoded.arrays["compress.index"].copy()
    index[0] = sum(t.numel() for t in _tensors().values())
    with pytest.raises(CompressionError, match="index outside"):
        decode({**encoded.arrays, "compress.index": index}, encoded.shapes, scheme)
    bf16 = Scheme(name="bf16")
    encoded = encode({"w": torch.tensor([1.0, float("inf")])}, bf16)
    with pytest.raises(CompressionError, match="NaN or Inf"):
        decode(encoded.arrays, encoded.shapes, bf16)


@pytest.mark.parametrize("name", ["bf16", "int8", "int4", "topk", "powersgd"])
def test_error_feedback_makes_the_decoded_sum_track_the_true_sum(name):
    """sum of decoded = sum of true - last residual, exactly; and the residual stays bounded (top-k's
    contraction ||x - topk(x)|| <= sqrt(1 - f) ||x|| bounds it by sqrt(1-f) / (1 - sqrt(1-f)) max ||u||)."""
    scheme = Scheme(name=name, topk_fraction=0.1, rank=2)
    feedback = ErrorFeedback("key", {}, {})
    true_sum = {n: torch.zeros_like(t) for n, t in _tensors().items()}
    sent_sum = {n: torch.zeros_like(t) for n, t in _tensors().items()}
    largest = 0.0
    for step in range(30):
        update = _tensors(seed=step)
        largest = max(largest, float(torch.cat([t.reshape(-1) for t in update.values()]).norm()))
        arrays, description = feedback.compress(update, scheme)
        reply = make_reply({}, 5)
        reply.content["arrays"], reply.content[RECORD] = arrays, description
        decoded = from_record(decode_reply(reply, scheme).content["arrays"])
        for n in true_sum:
            true_sum[n] += update[n]
            sent_sum[n] += decoded[n]
    for n in true_sum:
        torch.testing.assert_close(
            sent_sum[n] + feedback.residuals[n], true_sum[n], atol=1e-3, rtol=1e-4
        )
    residual = float(torch.cat([r.reshape(-1) for r in feedback.residuals.values()]).norm())
    contraction = math.sqrt(1 - 0.1)
    assert residual <= contraction / (1 - contraction) * largest


def _train_message(config: dict) -> Message:
    content = RecordDict({"arrays": ArrayRecord(), "config": ConfigRecord(config)})
    message = Message(content, dst_node_id=1, message_type="train")
    return message


def _site_reply(message: Message, update: dict[str, torch.Tensor]) -> Message:
    content = RecordDict(
        {"arrays": to_record(update), "metrics": MetricRecord({"num-examples": 5})}
    )
    return Message(content, reply_to=message)


def _context(state_dir) -> Context:
    return Context(
        run_id=7,
        node_id=1,
        node_config={"partition-id": 0, "state-dir": str(state_dir)},
        state=RecordDict(),
        run_config={},
    )


def test_residuals_survive_a_site_restart_and_start_again_on_other_coordinates(tmp_path):
    config = {"compress": "topk", "compress-topk-fraction": 0.05}
    message, update = _train_message(config), _tensors()
    first = _context(tmp_path)
    reply = compress_reply(message, _site_reply(message, update), first)
    assert set(reply.content[RECORD]["names"]) == set(update)
    kept = ErrorFeedback.load(
        first, None, coordinates_key(config, Scheme.from_config(config))
    ).residuals
    assert (
        float(kept["layer.weight"].abs().sum()) > 0 and float(kept["scale"]) == 0
    )  # a scalar is its own top 1
    restarted = _context(tmp_path)  # a new process: empty state, the same state directory
    key = coordinates_key(config, Scheme.from_config(config))
    restored = ErrorFeedback.load(restarted, tmp_path, key).residuals
    assert restored.keys() == kept.keys() and all(torch.equal(restored[n], kept[n]) for n in kept)
    other = coordinates_key({**config, "hydra.layers": [0]}, Scheme.from_config(config))
    assert ErrorFeedback.load(restarted, tmp_path, other).residuals == {}


def test_a_message_without_compression_leaves_the_reply_alone():
    message = _train_message({"compress": "none"})
    reply = _site_reply(message, _tensors())
    assert (
        compress_reply(message, reply, _context("unused")) is reply and RECORD not in reply.content
    )


def test_the_run_option_is_checked():
    assert RunConfig(compress="powersgd", compress_rank=2).to_flower()["compress-rank"] == 2
    with pytest.raises(ConfigError, match="choose one of"):
        RunConfig(compress="gzip")
    with pytest.raises(ConfigError, match="compress-topk-fraction"):
        RunConfig(compress="topk", compress_topk_fraction=0.9)
    with pytest.raises(ConfigError, match="secagg"):
        RunConfig(strategy="fedavg", compress="int8", secagg=True)


def _run(cfg: RunConfig):
    return server_app.run_federation(
        InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower()), cfg
    )


@pytest.mark.parametrize("strategy", ["diloco", "fedavg"])
def test_a_compressed_run_counts_the_compressed_bytes(strategy):
    cfg = SMALL_RUN.replace(strategy=strategy, rounds=2)
    plain = _run(cfg)
    scheme = Scheme(name="topk", topk_fraction=0.05)
    compressed = _run(cfg.replace(compress="topk", compress_topk_fraction=0.05))
    shapes = {name: tuple(array.shape) for name, array in plain.arrays.items()}
    expected = sum(
        np.dtype(dtype).itemsize * math.prod(shape) + 128
        for dtype, shape in expected_arrays(scheme, shapes).values()
    )  # payload plus one 128-byte npy header per array
    for round_ in compressed.history[1:]:
        assert round_["bytes_up"] == cfg.sites * expected
        assert round_["bytes_down"] == plain.history[1]["bytes_down"]  # downloads stay whole
    assert sum(r["bytes_up"] for r in plain.history) >= 4 * sum(
        r["bytes_up"] for r in compressed.history
    )


def test_a_compressed_run_learns_like_an_uncompressed_one():
    cfg = SMALL_RUN.replace(strategy="diloco", rounds=4, local_steps=4)
    plain, compressed = _run(cfg), _run(cfg.replace(compress="int8"))
    assert compressed.history[-1]["accuracy"] == pytest.approx(
        plain.history[-1]["accuracy"], abs=0.03
    )
    assert compressed.history[-1]["loss"] == pytest.approx(plain.history[-1]["loss"], rel=0.02)


def test_hydra_sites_compress_the_compact_slices_they_send():
    plain = _run(TIERED_RUN)
    compressed = _run(TIERED_RUN.replace(compress="int8"))
    for before, after in zip(plain.history[1:], compressed.history[1:], strict=True):
        assert after["sites_ok"] == 3 and not after["rejected_per_site"]
        assert (
            before["bytes_up"] / after["bytes_up"] > 3.5
        )  # int8 and a scale per 256 values of the slices
    assert math.isfinite(compressed.history[-1]["loss"])
