"""FedBuff with its global model kept on disk (`resident_model_bytes`): each update folded into the buffer's
tensor file as it arrives, the step taken tensor by tensor into the next model file. The same bits as the
in-memory buffer for the same updates in the same arrival order, a checkpoint that names the model and momentum
files, a resume that goes on from them, and no buffer file left behind; FedBuff over Hydra-nets too, and a
refusal for a buffer whose on-disk rule is not its own."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord
from helpers import ASYNC_SITES, make_reply

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.server.aggregation.async_driver import AsyncDriver, VirtualClock, simulated_speeds
from hydrafl.server.aggregation.checkpoint import load_checkpoint
from hydrafl.server.aggregation.driver import DriverConfig, RoundFailed
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies.by_tensor import RoundFiles, buffers_by_its_rule
from hydrafl.strategies.fedbuff import FedBuff, FedBuffConfig
from hydrafl.strategies.fedbuff_hydra import FedBuffHydra
from hydrafl.tensor_files import MappedArray, open_tensors, save_tensors

ASYNC = {
    **ASYNC_SITES,
    "site_speeds": "1,1,1,0.25",
    "strategy": "fedbuff",
    "buffer_size": 3,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
}
"""Three sites a step's worth of updates each virtual second, a fourth four times slower: its updates arrive
three versions stale."""
TIMING_KEYS = {"seconds", "aggregation_s", "gap_s"}


def _run(cfg: RunConfig, resident_model_bytes: int | None = None):
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(
        grid,
        cfg,
        virtual_speeds=simulated_speeds(grid.contexts, cfg.speed_list),
        resident_model_bytes=resident_model_bytes,
    )


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in history]


def _assert_same_model(on_disk: ArrayRecord, in_memory: ArrayRecord, folder: Path) -> None:
    assert list(on_disk) == list(in_memory)
    for name, array in in_memory.items():
        kept = on_disk[name]
        assert isinstance(kept, MappedArray) and Path(kept.path).parent == folder
        np.testing.assert_array_equal(kept.numpy(), array.numpy())


def _committed(folder: Path) -> list[str]:
    """The checkpoint's tensor files by kind, after checking that no other round file is left."""
    checkpoint = json.loads((folder / "checkpoint.json").read_text())
    left = {path.name for path in folder.glob("round-*.safetensors")}
    assert left == {checkpoint["tensors"], *checkpoint["files"]}  # no buffer, no older model
    return sorted(name.split("-")[2] for name in checkpoint["files"])


HYDRA = {"strategy": "fedbuff-hydra", "site_tiers": "small,large", "buffer_size": 2}


@pytest.mark.parametrize(
    "knobs",
    [{"rounds": 6, "weight_cap": 1.2}, {**HYDRA, "rounds": 5}],
    ids=["fedbuff", "fedbuff-hydra"],
)
def test_fedbuff_on_disk_ends_with_the_in_memory_bits(tmp_path, knobs):
    """FedBuff, and FedBuff over Hydra-nets (each site's slices folded into full-shape sums and per-coordinate
    weights, both in the buffer's file; the masked step)."""
    cfg = RunConfig.build(**{**ASYNC, **knobs})
    in_memory = _run(cfg.replace(run_dir=str(tmp_path / "memory")))
    folder = tmp_path / "disk"
    on_disk = _run(cfg.replace(run_dir=str(folder)), resident_model_bytes=0)
    assert _numbers(on_disk.history) == _numbers(in_memory.history)
    assert max(max(record["staleness"]) for record in in_memory.history[1:]) >= 3
    _assert_same_model(on_disk.arrays, in_memory.arrays, folder)
    assert _committed(folder) == ["model", "momentum"]
    files = json.loads((folder / "checkpoint.json").read_text())["files"]
    assert all(name.startswith(f"round-{cfg.rounds:05d}-") for name in files)


@pytest.mark.parametrize("knobs", [{}, HYDRA], ids=["fedbuff", "fedbuff-hydra"])
def test_a_resumed_fedbuff_on_disk_goes_on_from_its_files_as_in_memory(tmp_path, knobs):
    """A resume starts a new buffer and sends every site the saved model (in memory too: the updates in flight
    are lost), so both resumed runs are compared: the same bits, the second half stepped from the model and
    momentum files the checkpoint named."""
    cfg = RunConfig.build(**{**ASYNC, **knobs}, rounds=3)
    runs = {}
    for where, resident in (("memory", None), ("disk", 0)):
        first = cfg.replace(run_dir=str(tmp_path / where))
        _run(first, resident)
        runs[where] = _run(first.replace(rounds=5, resume=True), resident)
    saved = load_checkpoint(tmp_path / "disk")
    assert saved is not None and saved.server_round == 5
    momentum = saved.strategy_state["momentum_buffer"]
    assert momentum and all(isinstance(buffer, MappedArray) for buffer in momentum.values())
    assert [record["round"] for record in runs["disk"].history] == [0, 1, 2, 3, 4, 5]
    assert _numbers(runs["disk"].history) == _numbers(runs["memory"].history)
    _assert_same_model(runs["disk"].arrays, runs["memory"].arrays, tmp_path / "disk")
    assert _committed(tmp_path / "disk") == ["model", "momentum"]


START = {
    "w": np.array([1.0, -2.0, 0.5], dtype=np.float32),
    "b": np.array([[0.25, -1.0]], dtype=np.float32),
}
DELTAS = {
    1: {"w": [0.3, 0.0, -0.6]},
    2: {"w": [0.9, 0.3, 0.0], "b": [[1.0, 2.0]]},
    3: {"w": [-0.3, 0.6, 0.3]},
}


def _replies() -> list:
    return [make_reply(DELTAS[node], 10, node) for node in (1, 2, 3)]


def test_the_buffer_file_holds_the_staleness_weighted_sums_of_a_planted_arrival_order(tmp_path):
    """Planted: node 1 fresh, node 2 three versions stale, node 3 fresh; weights capped at 0.9, the stale one
    1/sqrt(4) = 0.5. The buffer's file holds sum w delta as the updates arrive ("b" only from node 2's), the step
    is sum w delta / K through lr 0.5 and Nesterov momentum 0.5, the second buffer reads the momentum back
    from its file; and every value is the in-memory FedBuff's, bit for bit."""
    config = FedBuffConfig(buffer_size=3, weight_cap=0.9, outer_lr=0.5, outer_momentum=0.5)
    on_disk, in_memory = FedBuff(config), FedBuff(config)
    disk_arrays = _record(save_tensors(tmp_path / "start.safetensors", START))
    memory_arrays = _record({name: Array(values) for name, values in START.items()})
    deltas = {n: {k: np.array(v, np.float32) for k, v in d.items()} for n, d in DELTAS.items()}
    weights = {1: 0.9, 2: 0.5, 3: 0.9}
    expected = {name: values.astype(np.float64) for name, values in START.items()}
    momentum = {name: np.zeros_like(values, np.float64) for name, values in START.items()}
    for version in (0, 1):
        files = RoundFiles(tmp_path, version + 1)
        sums = {name: np.zeros_like(values, np.float64) for name, values in START.items()}
        for reply, (node, tau) in zip(_replies(), ((1, 0), (2, 3), (3, 0)), strict=True):
            on_disk.add_on_disk(reply, tau, disk_arrays, files)
            in_memory.add(make_reply(DELTAS[node], 10, node), tau)
            for name, delta in deltas[node].items():
                sums[name] += weights[node] * delta
            [buffer] = tmp_path.glob(f"round-{version + 1:05d}-buffer-*.safetensors")
            kept = open_tensors(buffer)
            for name in deltas[node]:
                np.testing.assert_allclose(kept[name].numpy(), sums[name], rtol=1e-6)
        disk_arrays, _, report = on_disk.step_on_disk(disk_arrays, files)
        memory_arrays, _, _ = in_memory.step(memory_arrays)
        assert report.weights == pytest.approx([0.9, 0.5, 0.9]) and report.staleness == [0, 3, 0]
        assert not list(tmp_path.glob("round-*-buffer-*"))  # the spent buffer's file is gone
        for name in START:
            mean = sums[name] / 3
            momentum[name] = 0.5 * momentum[name] + mean
            expected[name] -= 0.5 * (mean + 0.5 * momentum[name])
            np.testing.assert_allclose(disk_arrays[name].numpy(), expected[name], rtol=1e-5)
            np.testing.assert_array_equal(disk_arrays[name].numpy(), memory_arrays[name].numpy())
            assert isinstance(on_disk.outer.momentum_buffer[name], MappedArray)


def test_a_skipped_buffer_on_disk_keeps_the_model_file_and_drops_its_sums(tmp_path):
    strategy = FedBuff(FedBuffConfig(buffer_size=2, ess_min=2.0, ess_action="skip"))
    arrays = _record(save_tensors(tmp_path / "start.safetensors", START))
    files = RoundFiles(tmp_path, 1)
    for tau in (0, 1):  # one site twice: ESS 1
        strategy.add_on_disk(make_reply(DELTAS[1], 10, 1), tau, arrays, files)
    kept, _, report = strategy.step_on_disk(arrays, files)
    assert report.skipped and kept is arrays
    assert not list(tmp_path.glob("round-*"))  # neither a buffer file nor a new model


def _record(arrays: dict) -> ArrayRecord:
    record = ArrayRecord()
    for name, array in arrays.items():
        record[name] = array
    return record


class _ChangedInMemory(FedBuff):
    """A buffer whose in-memory rule a subclass changed, and whose on-disk one it did not."""

    def add(self, reply, staleness):
        super().add(reply, staleness)


def test_a_buffer_whose_rule_on_disk_is_not_its_own_is_refused_before_any_step(tmp_path):
    assert buffers_by_its_rule(FedBuff()) and buffers_by_its_rule(FedBuffHydra())
    assert not buffers_by_its_rule(_ChangedInMemory())
    cfg = RunConfig.build(**ASYNC, rounds=1)
    grid = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    config = DriverConfig(num_rounds=1, required_sites=1, run_dir=tmp_path, resident_model_bytes=0)
    driver = AsyncDriver(grid, _ChangedInMemory(), config, VirtualClock(grid, {}))
    model = _record({name: Array(values) for name, values in START.items()})
    with pytest.raises(RoundFailed, match="_ChangedInMemory folds its buffer's updates in memory"):
        driver.run(lambda: model)
    assert not list(tmp_path.iterdir())  # nothing written
