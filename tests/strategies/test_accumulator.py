"""The streaming accumulator equals the batch weighted mean (to float tolerance, and bitwise whatever its thread
count), reads memory-mapped replies in place, and refuses replies it cannot combine."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import Array
from helpers import make_reply

from hydrafl.privacy.central import CentralDp
from hydrafl.strategies import AggregationError, MaskedDeltaAccumulator, WeightedDeltaAccumulator
from hydrafl.strategies import parallel_fold as fold
from hydrafl.strategies.accumulator import _views
from hydrafl.subnet.slices import Slice


def test_streamed_mean_equals_weighted_mean():
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(7)]
    weights = [3, 1, 4, 1, 5, 9, 2]
    accumulator = WeightedDeltaAccumulator()
    accumulator.add_all(
        make_reply({"w": d}, n, node_id=i + 1)
        for i, (d, n) in enumerate(zip(deltas, weights, strict=True))
    )
    expected = sum(n * d for d, n in zip(deltas, weights, strict=True)) / sum(weights)
    np.testing.assert_allclose(accumulator.mean()["w"].numpy(), expected, rtol=1e-6)
    assert accumulator.total_weight == sum(weights)
    assert len(accumulator.metric_records) == 7


def test_shape_mismatch_and_empty_input_are_errors():
    accumulator = WeightedDeltaAccumulator()
    accumulator.add(make_reply({"w": np.zeros((2, 2))}, 1))
    with pytest.raises(AggregationError, match="shape"):
        accumulator.add(make_reply({"w": np.zeros((3, 2))}, 1, node_id=2))
    with pytest.raises(AggregationError, match="no successful reply"):
        WeightedDeltaAccumulator().mean()
    with pytest.raises(AggregationError, match="num-examples"):
        WeightedDeltaAccumulator().add(make_reply({"w": np.zeros(2)}, 0))


def test_compact_slices_fold_into_the_masked_mean_by_hand():
    """Site A (weight 2) trained columns 0-1 of a 2x3 tensor, site B (weight 1) columns 1-2; each sent only
    its columns. Column 0 is A's delta, column 2 is B's, column 1 is (2 A + 1 B) / 3; `bias` nobody trained."""
    shapes = {"w": (2, 3), "bias": (3,)}
    accumulator = MaskedDeltaAccumulator()
    a = make_reply({"w": np.array([[1, 2], [3, 4]], dtype=np.float32)}, num_examples=2, node_id=1)
    b = make_reply(
        {"w": np.array([[10, 20], [30, 40]], dtype=np.float32)}, num_examples=1, node_id=2
    )
    accumulator.add_slices(a, {"w": Slice(1, (0, 1))}, shapes)
    accumulator.add_slices(b, {"w": Slice(1, (1, 2)), "bias": Slice(None)}, shapes)
    mean = accumulator.mean()
    assert set(mean) == {"w"}
    delta, trained = mean["w"]
    np.testing.assert_allclose(delta.numpy(), [[1, 14 / 3, 20], [3, 38 / 3, 40]], rtol=1e-6)
    assert trained.all()


def test_compact_slices_count_once_and_refuse_a_wrong_slice_shape():
    shapes = {"w": (2, 3)}
    accumulator = MaskedDeltaAccumulator()
    a = make_reply({"w": np.full((2, 1), 3.0, dtype=np.float32)}, num_examples=5, node_id=1)
    b = make_reply({"w": np.full((2, 1), 6.0, dtype=np.float32)}, num_examples=1, node_id=2)
    accumulator.add_slices(a, {"w": Slice(1, (2,))}, shapes, count_once=True)
    accumulator.add_slices(b, {"w": Slice(1, (2,))}, shapes, count_once=True)
    with pytest.raises(AggregationError, match=r"has shape \(2, 1\), its slice is \(2, 2\)"):
        accumulator.add_slices(b, {"w": Slice(1, (0, 2))}, shapes)
    with pytest.raises(AggregationError, match="outside its subnetwork"):
        accumulator.add_slices(b, {}, shapes)
    delta, trained = accumulator.mean()["w"]
    np.testing.assert_allclose(delta.numpy(), [[0, 0, 4.5], [0, 0, 4.5]])  # plain mean of 3 and 6
    assert trained.tolist() == [[False, False, True], [False, False, True]]


# --- block-wise parallel folding: equal to a float64 reference, bit-identical whatever the thread count ---

SITES = 5
TOLERANCE = 1e-5  # float32 sums of N(0, 1) values against float64: rounding is ~1e-7 here


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 1000 elements, so these small arrays span many blocks and an uneven last one."""
    monkeypatch.setattr(fold, "BLOCK", 1000)


def site_deltas(site: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(site)
    return {
        "w": rng.standard_normal((37, 211), dtype=np.float32),
        "b": rng.standard_normal(4999, dtype=np.float32),
        "tiny": rng.standard_normal(3, dtype=np.float32),
    }


def site_masks(site: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(100 + site)
    return {
        name: torch.from_numpy(rng.random(delta.shape) < 0.6)
        for name, delta in site_deltas(0).items()
    }


def replies(sites: int = SITES) -> list:
    return [
        make_reply(site_deltas(site), num_examples=3 + 2 * site, node_id=site + 1)
        for site in range(sites)
    ]


def weights(sites: int = SITES) -> list[float]:
    return [3.0 + 2 * site for site in range(sites)]


def clipped(deltas: dict[str, np.ndarray], bound: float) -> float:
    norm = np.sqrt(sum(float(np.sum(d.astype(np.float64) ** 2)) for d in deltas.values()))
    return min(1.0, bound / norm)


@pytest.mark.parametrize("dp_clip", [None, 20.0])
def test_weighted_blocks_equal_the_reference_and_are_bit_identical_across_threads(
    small_blocks, dp_clip
):
    """DP with z = 0: each reply is clipped to C = 20 (their norms are ~55) and counts once, no noise."""
    means = {}
    for threads in (1, 2, 3):
        accumulator = WeightedDeltaAccumulator(
            dp=dp_clip and CentralDp(0.0, dp_clip), threads=threads
        )
        accumulator.add_all(replies())
        means[threads] = accumulator.mean()
    factors = [
        clipped(site_deltas(s), dp_clip) if dp_clip else w
        for s, w in zip(range(SITES), weights(), strict=True)
    ]
    assert dp_clip is None or max(factors) < 1  # every reply was really clipped
    for name in site_deltas(0):
        reference = sum(f * site_deltas(s)[name].astype(np.float64) for s, f in enumerate(factors))
        reference /= SITES if dp_clip else sum(weights())
        np.testing.assert_allclose(means[1][name].numpy(), reference, rtol=0, atol=TOLERANCE)
        assert torch.equal(means[1][name], means[2][name]) and torch.equal(
            means[1][name], means[3][name]
        )


def test_grouped_streamed_and_one_by_one_folds_are_bit_identical(small_blocks):
    grouped, streamed, single = (WeightedDeltaAccumulator(threads=2) for _ in range(3))
    grouped.add_all(replies())  # a list: folded GROUP at a time
    streamed.add_all(iter(replies()))  # an iterator: one at a time
    for reply in replies():
        single.add(reply)
    assert grouped.total_weight == streamed.total_weight == single.total_weight == sum(weights())
    a, b, c = grouped.mean(), streamed.mean(), single.mean()
    assert all(torch.equal(a[name], b[name]) and torch.equal(a[name], c[name]) for name in a)


def test_a_bad_reply_in_a_group_raises_after_the_replies_before_it_are_folded():
    accumulator = WeightedDeltaAccumulator()
    group = [
        make_reply({"w": np.ones(3)}, 1, node_id=1),
        make_reply({"w": np.ones(4)}, 1, node_id=2),
    ]
    with pytest.raises(AggregationError, match=r"'w' has shape \(4,\), expected \(3,\)"):
        accumulator.add_all(group)
    assert accumulator.total_weight == 1.0 and accumulator.mean()["w"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("dp_clip", [None, 15.0])
def test_masked_blocks_equal_the_reference_and_are_bit_identical_across_threads(
    small_blocks, dp_clip
):
    """Clipping uses the norm over each site's assigned coordinates only."""
    results = {}
    for threads in (1, 2):
        accumulator = MaskedDeltaAccumulator(
            dp=dp_clip and CentralDp(0.0, dp_clip), threads=threads
        )
        for site, reply in enumerate(replies()):
            accumulator.add(reply, site_masks(site))
        results[threads] = accumulator.mean()
    masked = [
        {n: d * site_masks(s)[n].numpy() for n, d in site_deltas(s).items()} for s in range(SITES)
    ]
    factors = [
        clipped(masked[s], dp_clip) if dp_clip else w
        for s, w in zip(range(SITES), weights(), strict=True)
    ]
    counted = [1.0] * SITES if dp_clip else weights()
    assert dp_clip is None or max(factors) < 1
    for name in site_deltas(0):
        sums = sum(f * masked[s][name].astype(np.float64) for s, f in enumerate(factors))
        counts = sum(c * site_masks(s)[name].numpy() for s, c in enumerate(counted))
        delta, trained = results[1][name]
        np.testing.assert_allclose(
            delta.numpy(),
            np.where(counts > 0, sums / np.maximum(counts, 1e-30), 0),
            rtol=0,
            atol=TOLERANCE,
        )
        assert trained.numpy().tolist() == (counts > 0).tolist()
        assert torch.equal(delta, results[2][name][0]) and torch.equal(trained, results[2][name][1])


@pytest.mark.parametrize("dp_clip", [None, 10.0])
def test_sliced_blocks_equal_the_reference_and_are_bit_identical_across_threads(
    small_blocks, dp_clip
):
    """Compact uploads of column, row and whole slices, with row blocks of ~1000 elements."""
    shapes = {"w": (37, 211), "v": (50, 40), "b": (4999,)}
    slices = [
        {"w": Slice(1, range(s, 211, 2)), "v": Slice(0, range(s, 50, 3)), "b": Slice(None)}
        for s in range(3)
    ]
    full = {
        name: [np.random.default_rng(s).standard_normal(shape, dtype=np.float32) for s in range(3)]
        for name, shape in shapes.items()
    }
    uploads = [
        {name: sl.take(torch.from_numpy(full[name][s])).numpy() for name, sl in slices[s].items()}
        for s in range(3)
    ]
    results = {}
    for threads in (1, 2):
        accumulator = MaskedDeltaAccumulator(
            dp=dp_clip and CentralDp(0.0, dp_clip), threads=threads
        )
        for s in range(3):
            accumulator.add_slices(
                make_reply(uploads[s], num_examples=2 + s, node_id=s + 1), slices[s], shapes
            )
        results[threads] = accumulator.mean()
    factors = [clipped(uploads[s], dp_clip) if dp_clip else 2.0 + s for s in range(3)]
    counted = [1.0] * 3 if dp_clip else [2.0 + s for s in range(3)]
    for name, shape in shapes.items():
        masks = [slices[s][name].mask(shape).numpy() for s in range(3)]
        sums = sum(
            f * m * full[name][s].astype(np.float64)
            for s, (f, m) in enumerate(zip(factors, masks, strict=True))
        )
        counts = sum(c * m for c, m in zip(counted, masks, strict=True))
        delta, trained = results[1][name]
        np.testing.assert_allclose(
            delta.numpy(),
            np.where(counts > 0, sums / np.maximum(counts, 1e-30), 0),
            rtol=0,
            atol=TOLERANCE,
        )
        assert trained.numpy().tolist() == (counts > 0).tolist()
        assert torch.equal(delta, results[2][name][0])


def memory_mapped_reply(path, deltas: dict[str, np.ndarray], num_examples: float, node_id: int):
    """A reply whose arrays are read-only views of one file holding their .npy bytes, as the blob store hands
    over an upload."""
    blobs = {}
    for name, delta in deltas.items():
        buffer = io.BytesIO()
        np.save(buffer, delta, allow_pickle=False)
        blobs[name] = buffer.getvalue()
    path.write_bytes(b"".join(blobs.values()))
    mapped = memoryview(np.memmap(path, dtype=np.uint8, mode="r"))
    reply = make_reply({name: np.zeros(0) for name in deltas}, num_examples, node_id)
    record, offset = reply.content["arrays"], 0
    for name, blob in blobs.items():
        record[name] = Array(
            dtype="float32", shape=deltas[name].shape, stype="numpy.ndarray", data=b""
        )
        record[name].data = mapped[offset : offset + len(blob)]
        offset += len(blob)
    return reply


def resident_bytes(field: str = "VmRSS") -> int:
    status = Path("/proc/self/status").read_text()
    return (
        int(next(line for line in status.splitlines() if line.startswith(f"{field}:")).split()[1])
        * 1024
    )


def test_memory_mapped_replies_fold_in_place_and_leave_only_the_sums_resident(tmp_path):
    """8 replies of 2 x 8 MB, all held, as a round holds its replies: the result equals the in-memory fold,
    and the process keeps only the sums (one model) resident, not a model per reply; at its peak, the sums and
    the one reply being folded."""
    model_bytes = 2 * 2_000_000 * 4
    deltas = [
        {
            f"layer{i}": np.random.default_rng(10 * s + i).standard_normal(
                2_000_000, dtype=np.float32
            )
            for i in range(2)
        }
        for s in range(8)
    ]
    in_memory = WeightedDeltaAccumulator(threads=2)
    in_memory.add_all([make_reply(d, 1 + s, node_id=s + 1) for s, d in enumerate(deltas)])
    expected = in_memory.mean()
    mapped = [
        memory_mapped_reply(tmp_path / f"{s}.npy", d, 1 + s, s + 1) for s, d in enumerate(deltas)
    ]
    del deltas
    blob = np.frombuffer(mapped[0].content["arrays"]["layer0"].data, np.uint8)
    address = _views(mapped[0].content["arrays"])["layer0"].data_ptr() - blob.ctypes.data
    assert (
        0 < address < blob.nbytes
    )  # a view into the mapped file (after the .npy header), not a copy
    Path("/proc/self/clear_refs").write_text(
        "5"
    )  # restart the peak (VmHWM) from the current resident size
    before = resident_bytes()
    accumulator = WeightedDeltaAccumulator(threads=2)
    accumulator.add_all(mapped)
    mean = accumulator.mean()
    grown, peak = resident_bytes() - before, resident_bytes("VmHWM") - before
    assert all(torch.equal(mean[name], expected[name]) for name in expected)
    assert grown < 1.5 * model_bytes, f"resident memory grew by {grown / model_bytes:.1f} models"
    assert peak < 2.5 * model_bytes, (
        f"resident memory peaked {peak / model_bytes:.1f} models higher"
    )
