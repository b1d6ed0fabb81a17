"""A global model kept on disk and aggregated tensor by tensor (`resident_model_bytes`): the same bits as in
memory, a checkpoint that names its tensor files instead of copying them, a resume that reads them back, and a
clear refusal for what needs every reply in memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import make_reply

from hydrafl.client import site_app
from hydrafl.privacy.central import CentralDp
from hydrafl.server import server_app
from hydrafl.server.administration import export_run
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.aggregation.driver import RoundFailed
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import DiLoCo
from hydrafl.strategies.by_tensor import RoundFiles, read_ahead
from hydrafl.strategies.diloco import DiLoCoConfig
from hydrafl.tensor_files import MappedArray, OnDiskArray, save_tensors

TIMING_KEYS = {"seconds", "aggregation_s", "gap_s"}


def _run(cfg, resident_model_bytes=None):
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg, resident_model_bytes=resident_model_bytes)


def _numbers(history):
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in history]


@pytest.mark.parametrize(
    "strategy, knobs",
    [
        ("diloco", {"outer_lr": 0.7, "outer_momentum": 0.9}),
        ("fedavg", {}),
        ("fedmedian", {}),
        ("hydra", {"outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}),
        ("heterofl", {}),
    ],
)
def test_a_model_on_disk_ends_with_the_bits_of_one_in_memory(small_run, tmp_path, strategy, knobs):
    cfg = small_run.replace(strategy=strategy, rounds=2, **knobs)
    in_memory = _run(cfg.replace(run_dir=str(tmp_path / "memory")))
    folder = tmp_path / "disk"
    on_disk = _run(cfg.replace(run_dir=str(folder)), resident_model_bytes=0)
    assert _numbers(on_disk.history) == _numbers(in_memory.history)
    for name, array in in_memory.arrays.items():
        kept = on_disk.arrays[name]
        assert isinstance(kept, MappedArray) and Path(kept.path).parent == folder
        np.testing.assert_array_equal(kept.numpy(), array.numpy())
    checkpoint = json.loads((folder / "checkpoint.json").read_text())
    kinds = sorted(name.split("-")[2] for name in checkpoint["files"])
    assert kinds == (["model", "momentum"] if knobs.get("outer_momentum") else ["model"])
    assert all(name.startswith("round-00002-") for name in checkpoint["files"])
    left = {path.name for path in folder.glob("round-*.safetensors")}
    assert left == {checkpoint["tensors"], *checkpoint["files"]}  # earlier rounds' files are gone
    archived = {path.name for path in (folder / "checkpoints").glob("*")}
    assert set(checkpoint["files"]) <= archived or not archived
    if (
        strategy == "fedavg"
    ):  # the final model's export reads the checkpoint's files as it reads a copy
        exports = [
            export_run(run, tmp_path / f"export-{run.name}")
            for run in (folder, tmp_path / "memory")
        ]
        assert exports[0].kind == exports[1].kind
        weights = sorted((tmp_path / "export-memory").rglob("*.safetensors"))
        assert weights
        for path in weights:
            twin = tmp_path / "export-disk" / path.relative_to(tmp_path / "export-memory")
            assert twin.read_bytes() == path.read_bytes()


def test_a_resumed_model_on_disk_ends_like_a_straight_run(small_run, tmp_path):
    cfg = small_run.replace(strategy="diloco", rounds=3, outer_lr=0.5, outer_momentum=0.9)
    straight = _run(cfg.replace(run_dir=str(tmp_path / "straight")), resident_model_bytes=0)
    _run(cfg.replace(rounds=2, run_dir=str(tmp_path / "split")), resident_model_bytes=0)
    saved = load_checkpoint(tmp_path / "split")
    momentum = saved.strategy_state["momentum_buffer"]
    assert momentum and all(isinstance(buffer, MappedArray) for buffer in momentum.values())
    resumed = _run(
        cfg.replace(resume=True, run_dir=str(tmp_path / "split")), resident_model_bytes=0
    )
    assert _numbers(resumed.history) == _numbers(straight.history)
    for name, array in straight.arrays.items():
        np.testing.assert_array_equal(array.numpy(), resumed.arrays[name].numpy())


@pytest.mark.parametrize(
    "strategy, knobs, why",
    [
        ("fedadam", {}, "needs every reply in memory"),
        ("krum", {}, "needs every reply in memory"),
        ("hydra", {"robust_rule": "median"}, "robust rules need whole replies"),
    ],
)
def test_a_strategy_that_needs_every_reply_at_once_is_refused_before_any_round(
    small_run, tmp_path, strategy, knobs, why
):
    cfg = small_run.replace(strategy=strategy, rounds=1, run_dir=str(tmp_path), **knobs)
    with pytest.raises(RoundFailed, match=f"resident-model-mb.*{why}"):
        _run(cfg, resident_model_bytes=0)
    assert load_checkpoint(tmp_path) is None  # nothing was trained
    assert _run(cfg, resident_model_bytes=1 << 30).history[-1]["round"] == 1  # fits: in memory


def test_the_tensor_by_tensor_outer_step_is_the_whole_models_by_hand(tmp_path):
    """Two sites, weights 1 and 3, two rounds of Nesterov momentum 0.5 and lr 0.5 on a model of two tensors,
    the second round reading the momentum back from its file."""
    start = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[4.0]], np.float32)}
    deltas = [
        ({"a": np.array([1.0, 0.0], np.float32), "b": np.array([[2.0]], np.float32)}, 1.0),
        ({"a": np.array([1.0, 4.0], np.float32), "b": np.array([[-2.0]], np.float32)}, 3.0),
    ]
    strategy = DiLoCo(DiLoCoConfig(outer_lr=0.5, outer_momentum=0.5, outer_nesterov=True))
    arrays = _record(save_tensors(tmp_path / "start.safetensors", start))
    mean = {"a": np.array([1.0, 3.0]), "b": np.array([[-1.0]])}  # (1 d1 + 3 d2) / 4
    buffer = {name: np.zeros_like(values) for name, values in mean.items()}
    expected = {name: values.astype(np.float64) for name, values in start.items()}
    for server_round in (1, 2):
        strategy.current_arrays = arrays
        replies = [
            make_reply(delta, weight, node) for node, (delta, weight) in enumerate(deltas, 1)
        ]
        arrays, _ = strategy.aggregate_by_tensor(
            server_round, replies, arrays, RoundFiles(tmp_path, server_round)
        )
        for name in expected:
            buffer[name] = 0.5 * buffer[name] + mean[name]
            expected[name] = expected[name] - 0.5 * (mean[name] + 0.5 * buffer[name])
            np.testing.assert_allclose(arrays[name].numpy(), expected[name], rtol=1e-6)
            assert isinstance(strategy.outer.momentum_buffer[name], OnDiskArray)
    shorter = [make_reply({"b": np.array([[1.0]], np.float32)}, 1.0, 9)]
    cuts = {name: cut for name, _, cut in read_ahead(arrays, [*replies, *shorter], ["b", "a"])}
    assert list(cuts) == ["b", "a"] and [len(cuts["a"]), len(cuts["b"])] == [2, 3]
    assert [list(cut.content["arrays"].keys()) for cut in cuts["b"]] == [["b"]] * 3


def _record(arrays: dict) -> ArrayRecord:
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


@pytest.mark.slow
def test_over_grpc_a_model_on_disk_gives_the_in_memory_numbers(small_run, tmp_path):
    """A real coordinator that keeps every model on disk (`--resident-model-mb 0`: replies stay in its blob
    store, the model in its run folder) and real site processes end each round with the in-process numbers."""
    from deployment import run_to_end

    from hydrafl.simulation.compare import run_strategy

    cfg = small_run.replace(strategy="diloco", rounds=2, outer_lr=0.7, outer_momentum=0.9)
    inprocess = run_strategy(cfg.replace(run_dir=str(tmp_path / "in")), "inprocess")
    store, run_id = run_to_end(
        tmp_path, cfg, [()] * cfg.sites, timeout_s=600, server_options=("--resident-model-mb", "0")
    )
    run = store.run(run_id)
    assert run.status == "finished", run.detail
    assert [r["loss"] for r in run.history] == pytest.approx(
        [r["loss"] for r in inprocess], rel=1e-5
    )
    assert [r["bytes_up"] for r in run.history] == [r["bytes_up"] for r in inprocess]
    folder = next((tmp_path).glob(f"**/runs/{run_id}"))
    checkpoint = json.loads((folder / "checkpoint.json").read_text())
    assert sorted(name.split("-")[2] for name in checkpoint["files"]) == ["model", "momentum"]


def test_central_dp_tensor_by_tensor_clips_and_noises_as_in_memory(tmp_path):
    """DiLoCo with central DP: each reply clipped by the norm of its whole update (read a tensor at a time, in a
    first pass), counted once, the mean noised in the order the in-memory fold noises it; with the same noise
    seed, the same bits over two rounds (the second on momentum read back from its file)."""
    rng = np.random.default_rng(0)
    start = {
        name: rng.standard_normal(shape).astype(np.float32)
        for name, shape in (("b", (5,)), ("a", (3, 4)), ("c", (2, 2, 2)))
    }
    deltas = [
        (
            {
                name: rng.standard_normal(v.shape).astype(np.float32) * scale
                for name, v in start.items()
            },
            w,
        )
        for scale, w in ((0.1, 2.0), (3.0, 1.0), (0.5, 5.0))
    ]  # the second is clipped hardest, the first not at all
    config = DiLoCoConfig(outer_lr=0.7, outer_momentum=0.9)
    in_memory, on_disk = DiLoCo(config), DiLoCo(config)
    in_memory.central_dp = CentralDp(0.8, 1.0, seed=7)
    on_disk.central_dp = CentralDp(0.8, 1.0, seed=7)
    memory_arrays = _record({n: Array(v) for n, v in start.items()})
    disk_arrays = _record(save_tensors(tmp_path / "start.safetensors", start))
    for server_round in (1, 2):
        replies = [make_reply(d, w, node) for node, (d, w) in enumerate(deltas, 1)]
        in_memory.current_arrays = memory_arrays
        memory_arrays, _ = in_memory.aggregate_train(server_round, iter(replies))
        replies = [make_reply(d, w, node) for node, (d, w) in enumerate(deltas, 1)]
        on_disk.current_arrays = disk_arrays
        disk_arrays, _ = on_disk.aggregate_by_tensor(
            server_round, replies, disk_arrays, RoundFiles(tmp_path, server_round)
        )
        for name in start:
            np.testing.assert_array_equal(disk_arrays[name].numpy(), memory_arrays[name].numpy())
            assert not np.array_equal(memory_arrays[name].numpy(), start[name])


def test_a_model_on_disk_reports_the_privacy_spent_in_memory(small_run, tmp_path):
    """Central DP on a model on disk: the same epsilon per round as in memory (the noise itself is drawn from
    the operating system's randomness, so the models differ)."""
    cfg = small_run.replace(
        strategy="diloco",
        rounds=2,
        outer_lr=0.7,
        outer_momentum=0.9,
        dp_clip=0.05,
        dp_noise_multiplier=0.8,
    )
    in_memory = _run(cfg.replace(run_dir=str(tmp_path / "memory")))
    on_disk = _run(cfg.replace(run_dir=str(tmp_path / "disk")), resident_model_bytes=0)
    spent = [record["dp_epsilon"] for record in in_memory.history]
    assert spent[-1] > 0 and [record["dp_epsilon"] for record in on_disk.history] == spent
    assert all(np.isfinite(array.numpy()).all() for array in on_disk.arrays.values())
