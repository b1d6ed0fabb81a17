"""A global model kept on disk and aggregated tensor by tensor (`resident_model_bytes`): the same bits as in
memory, a checkpoint that names its tensor files instead of copying them, a resume that reads them back, and a
clear refusal for what needs every reply in memory."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord
from helpers import make_reply

from hydrafl.client import site_app
from hydrafl.server import server_app
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.aggregation.driver import RoundFailed
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import DiLoCo
from hydrafl.strategies.by_tensor import RoundFiles, tensor_replies
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
    assert kinds == (["model", "momentum"] if strategy == "diloco" else ["model"])
    assert all(name.startswith("round-00002-") for name in checkpoint["files"])
    left = {path.name for path in folder.glob("round-*.safetensors")}
    assert left == {checkpoint["tensors"], *checkpoint["files"]}  # earlier rounds' files are gone
    archived = {path.name for path in (folder / "checkpoints").glob("*")}
    assert set(checkpoint["files"]) <= archived or not archived


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


@pytest.mark.parametrize("strategy", ["fedadam", "krum"])
def test_a_strategy_that_needs_every_reply_at_once_is_refused_before_any_round(
    small_run, tmp_path, strategy
):
    cfg = small_run.replace(strategy=strategy, rounds=1, run_dir=str(tmp_path))
    with pytest.raises(RoundFailed, match="resident-model-mb.*needs every reply in memory"):
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
    assert [len(tensor_replies(replies, name)) for name in ("a", "b", "c")] == [2, 2, 0]


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
