"""Checkpoints without pickle: every value of a strategy's state, the history and the run config read back bit
for bit (types included), every strategy's state round-trips exactly and resumes to the numbers of an
uninterrupted run, a crash mid-write keeps the previous round, an unknown object is refused by its key, and an
earlier hydrafl's pickle is read once and rewritten."""

from __future__ import annotations

import dataclasses
import math
import pickle
import struct
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from helpers import SMALL_RUN, TIERED_RUN
from safetensors import safe_open

from hydrafl.client import site_app
from hydrafl.config import RunConfig
from hydrafl.server import server_app
from hydrafl.server.aggregation import checkpoint as checkpoints
from hydrafl.server.aggregation.checkpoint import (
    CHECKPOINT_FILE,
    PICKLE_FILE,
    Checkpoint,
    CheckpointError,
    archive_checkpoint,
    load_checkpoint,
    save_checkpoint,
    stale_checkpoints,
)
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import hooks
from hydrafl.strategies.planner import SiteScores
from hydrafl.strategies.registry import build_strategy
from hydrafl.subnet.planning import LayerCost
from hydrafl.subnet.slices import Slice
from hydrafl.subnet.spec import SubnetSpec

TIMING_KEYS = {"seconds", "aggregation_s", "gap_s"}
LORA_RUN = SMALL_RUN.replace(local_steps=5, lr=1e-2, site_tiers="small,medium,large", lora_rank=8)
SIMPLE = (
    "fedavg",
    "fedavgm",
    "fedadam",
    "fedyogi",
    "fedadagrad",
    "fedprox",
    "fednova",
    "fedmedian",
)
RUNS = {
    **dict.fromkeys(
        (*SIMPLE, "fedtrimmedavg", "krum", "multikrum", "bulyan", "diloco", "fedbuff"), SMALL_RUN
    ),
    "scaffold": SMALL_RUN.replace(inner_optimizer="sgd", lr=0.05),
    **dict.fromkeys(("hydra", "heterofl", "fjord", "fedrolex", "fedbuff-hydra"), TIERED_RUN),
    **dict.fromkeys(("fedit", "flora", "hetlora", "flexlora"), LORA_RUN),
}
"""Each registered strategy's small run (the tiered and LoRA ones as their own tests run them)."""
KNOBS: dict[str, dict[str, Any]] = {
    "fedbuff": {"buffer_size": 2},
    "fedbuff-hydra": {"buffer_size": 2},
}


def _config(name: str, **changes: Any) -> RunConfig:
    return RUNS[name].replace(strategy=name, **KNOBS.get(name, {}), **changes)


QUICK = ("fedavg", "fedavgm", "fedadam", "diloco", "hydra", "fedbuff", "scaffold", "flora")
"""Checked in the quick suite; the others are slow."""


def assert_same(saved: Any, loaded: Any, where: str = "state") -> None:
    """Equal values of the same types, tensors and floats bit for bit, dicts in the same order."""
    assert type(saved) is type(loaded), (where, type(saved), type(loaded))
    if isinstance(saved, dict):
        assert list(saved) == list(loaded), where
        for key in saved:
            assert_same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(saved, torch.Tensor):
        assert (saved.dtype, saved.shape) == (loaded.dtype, loaded.shape), where
        assert torch.equal(_bits(saved), _bits(loaded)), where
    elif isinstance(saved, np.ndarray):
        assert (saved.dtype, saved.shape) == (loaded.dtype, loaded.shape), where
        assert saved.tobytes() == loaded.tobytes(), where
    elif isinstance(saved, ArrayRecord):
        assert list(saved) == list(loaded), where
        for name in saved:
            a, b = saved[name], loaded[name]
            assert (a.dtype, a.shape, bytes(a.data)) == (b.dtype, b.shape, bytes(b.data)), where
    elif isinstance(saved, float):
        assert struct.pack("<d", saved) == struct.pack("<d", loaded), where
    elif dataclasses.is_dataclass(saved):
        for field in dataclasses.fields(saved):
            assert_same(
                getattr(saved, field.name), getattr(loaded, field.name), f"{where}.{field.name}"
            )
    else:
        assert saved == loaded, where


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().flatten().view(torch.uint8)


def _checkpoint(server_round: int, state: dict[str, Any]) -> Checkpoint:
    arrays = ArrayRecord(
        {"w": Array(np.arange(6, dtype=np.float32).reshape(2, 3)), "b": Array(np.ones(3))}
    )
    return Checkpoint(
        server_round=server_round,
        arrays=arrays,
        strategy_state=state,
        history=[{"round": 0, "loss": 0.5, "staleness": [0, 1]}],
        run_config={"strategy": "fedavg", "lr": 0.003, "rounds": 3},
    )


def test_every_kind_of_state_value_reads_back_bit_for_bit(tmp_path):
    cost = LayerCost(fixed_s=0.1, per_layer_s=0.02, fixed_bytes=1e6, per_layer_bytes=2.5e5)
    state = {
        "momentum": {"w": torch.randn(2, 3), "half": torch.randn(4, dtype=torch.bfloat16)},
        "view": torch.arange(10.0)[2:5],  # a view of a bigger tensor: stored alone
        "m_t": {"w": np.random.default_rng(0).standard_normal((2, 3))},
        "vector": [np.zeros(2, dtype=np.int64), np.array(True)],
        "current_arrays": ArrayRecord({"z": Array(np.full(2, -0.0, dtype=np.float16))}),
        "floats": [math.nan, math.inf, -math.inf, -0.0, 0.1 + 0.2, np.float32(1 / 3), np.int64(7)],
        "per_node": {7: SubnetSpec(layers=(1, 0), heads=((0,), (1, 0))), 8: None},
        "site_scores": {
            7: SiteScores(layers=[0.5], heads=[[1.0, 2.0]], weight=3.0, tier="small", cost=cost)
        },
        "slices": {"w": Slice(dim=0, index=(1,)), "b": Slice(dim=None)},
        "layout": {"w": (0, 1, 2)},
        "budgets": {1: {"7": 12}},
        "$odd": {"$tensor": "not a tensor", (1, "a"): "a tuple key"},
        "empty": torch.zeros(0),
    }
    save_checkpoint(tmp_path, _checkpoint(4, state))
    loaded = load_checkpoint(tmp_path)
    assert loaded.server_round == 4
    for name in ("arrays", "strategy_state", "history", "run_config"):
        assert_same(getattr(_checkpoint(4, state), name), getattr(loaded, name), name)
    assert not (tmp_path / PICKLE_FILE).exists()


def test_arrays_the_state_shares_with_the_global_model_are_stored_once(tmp_path):
    """DiLoCo's `current_arrays` is the global model itself: one copy on disk, as the pickle had."""
    shared = _checkpoint(1, {})
    save_checkpoint(
        tmp_path, dataclasses.replace(shared, strategy_state={"current_arrays": shared.arrays})
    )
    [tensors] = tmp_path.glob("round-*.safetensors")
    assert sorted(safe_open(tensors, "pt").keys()) == ["arrays['b']", "arrays['w']"]
    loaded = load_checkpoint(tmp_path)
    assert_same(shared.arrays, loaded.strategy_state["current_arrays"])


def test_an_unknown_object_in_the_state_is_refused_by_its_key_before_anything_is_written(tmp_path):
    with pytest.raises(
        CheckpointError, match=r"strategy_state\['outer'\]\['rng'\] is a numpy.random"
    ):
        save_checkpoint(tmp_path, _checkpoint(1, {"outer": {"rng": np.random.default_rng(0)}}))
    with pytest.raises(CheckpointError, match=r"strategy_state\['fn'\] is a builtins.function"):
        save_checkpoint(tmp_path, _checkpoint(1, {"fn": lambda: 0}))
    assert list(tmp_path.iterdir()) == []


def test_a_crash_mid_write_leaves_the_previous_rounds_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, _checkpoint(1, {"step": torch.ones(2)}))

    def crash(*args):
        raise OSError("killed")

    with monkeypatch.context() as patch:
        patch.setattr(checkpoints.os, "replace", crash)
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(tmp_path, _checkpoint(2, {"step": torch.full((2,), 2.0)}))
    assert (
        len(list(tmp_path.glob("round-*.safetensors"))) == 2
    )  # round 2's tensors, never committed
    kept = load_checkpoint(tmp_path)
    assert kept.server_round == 1 and torch.equal(kept.strategy_state["step"], torch.ones(2))
    save_checkpoint(tmp_path, _checkpoint(3, {"step": torch.full((2,), 3.0)}))
    assert [p.name[:11] for p in tmp_path.glob("round-*.safetensors")] == ["round-00003"]
    assert load_checkpoint(tmp_path).server_round == 3


def test_the_last_rounds_are_kept_as_hard_links_and_older_ones_go(tmp_path):
    archived = tmp_path / "checkpoints"
    archived.mkdir()
    (archived / "round-00001.pkl").write_bytes(b"an earlier hydrafl's")
    for server_round in (2, 3, 4):
        save_checkpoint(tmp_path, _checkpoint(server_round, {"step": torch.ones(2) * server_round}))
        archive_checkpoint(tmp_path, server_round)
    current = tmp_path / CHECKPOINT_FILE
    assert (archived / "round-00004.json").stat().st_ino == current.stat().st_ino
    stale = stale_checkpoints(tmp_path, keep=2)
    assert [p.name[:11] for p in stale] == ["round-00001", "round-00002", "round-00002"]
    for path in stale:
        path.unlink()
    kept = checkpoints.read_checkpoint(archived / "round-00003.json")
    assert kept.server_round == 3 and torch.equal(
        kept.strategy_state["step"], torch.full((2,), 3.0)
    )
    assert load_checkpoint(tmp_path).server_round == 4


def test_an_earlier_hydrafls_pickle_is_read_once_with_a_warning_and_rewritten(tmp_path, caplog):
    old = _checkpoint(2, {"m_t": {"w": np.ones(3)}, "train_metrics_aggr_fn": len})
    with (tmp_path / PICKLE_FILE).open("wb") as handle:
        pickle.dump(old, handle)
    loaded = load_checkpoint(tmp_path)
    assert "a pickle, which runs code when read" in caplog.text
    assert not (tmp_path / PICKLE_FILE).exists() and (tmp_path / CHECKPOINT_FILE).exists()
    assert_same({"m_t": {"w": np.ones(3)}}, loaded.strategy_state)
    assert_same(old.arrays, loaded.arrays)
    caplog.clear()
    assert_same(loaded.strategy_state, load_checkpoint(tmp_path).strategy_state)
    assert "pickle" not in caplog.text


def test_a_pickle_in_a_folder_that_cannot_be_written_is_still_read(tmp_path, monkeypatch, caplog):
    with (tmp_path / PICKLE_FILE).open("wb") as handle:
        pickle.dump(_checkpoint(2, {"step": 2}), handle)

    def read_only(*args):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(checkpoints, "save_checkpoint", read_only)
    assert load_checkpoint(tmp_path).strategy_state == {"step": 2}
    assert "it stays a pickle" in caplog.text and (tmp_path / PICKLE_FILE).exists()


def _run(cfg: RunConfig, strategy=None, grid: InProcessGrid | None = None):
    grid = grid or InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    return server_app.run_federation(grid, cfg, strategy=strategy)


def _strategies(names: tuple[str, ...]) -> list:
    return [name if name in QUICK else pytest.param(name, marks=pytest.mark.slow) for name in names]


@pytest.mark.parametrize("name", _strategies(tuple(RUNS)))
def test_every_strategys_state_reads_back_exactly_as_it_was(name, tmp_path):
    """Two rounds, then the checkpoint's strategy state against the strategy's own, bit for bit; and a strategy
    built anew and given it exports the same state again (callables are rebuilt, never saved)."""
    cfg = _config(name, rounds=2, run_dir=str(tmp_path))
    strategy = build_strategy(cfg)
    _run(cfg, strategy)
    saved = hooks.strategy_state(strategy)
    loaded = load_checkpoint(tmp_path)
    assert loaded.server_round == 2
    assert_same(saved, loaded.strategy_state)
    rebuilt = build_strategy(cfg)
    hooks.restore_strategy_state(rebuilt, loaded.strategy_state)
    assert_same(saved, hooks.strategy_state(rebuilt))


SYNCHRONOUS = ("fedavg", "fedadam", "fedavgm", "diloco", "hydra", "scaffold", "flora", "hetlora")


@pytest.mark.slow
@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_a_resumed_run_ends_as_an_uninterrupted_one(name, tmp_path):
    """Round 3 resumed from round 2's checkpoint: the same arrays, history and strategy state as 3 rounds
    straight. The sites stay up (SCAFFOLD's keep their control variates): only the coordinator restarts."""
    cfg = _config(name, rounds=3)
    straight = _run(cfg.replace(run_dir=str(tmp_path / "straight")))
    sites = InProcessGrid(site_app.client_app, cfg.sites, cfg.to_flower())
    _run(cfg.replace(rounds=2, run_dir=str(tmp_path / "resumed")), grid=sites)
    resumed = _run(cfg.replace(resume=True, run_dir=str(tmp_path / "resumed")), grid=sites)
    assert_same(straight.arrays, resumed.arrays, "arrays")
    assert _numbers(straight.history) == _numbers(resumed.history)
    assert_same(
        load_checkpoint(tmp_path / "straight").strategy_state,
        load_checkpoint(tmp_path / "resumed").strategy_state,
    )


def _numbers(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in history]


def test_a_resumed_run_from_an_earlier_hydrafls_pickle_goes_on(small_run, tmp_path):
    """A run checkpointed as a pickle by an earlier hydrafl (Flower's callables in its state) resumes."""
    cfg = small_run.replace(strategy="fedadam", rounds=1, run_dir=str(tmp_path))
    strategy = build_strategy(cfg)
    _run(cfg, strategy)
    now = load_checkpoint(tmp_path)
    (tmp_path / CHECKPOINT_FILE).unlink()
    with (tmp_path / PICKLE_FILE).open("wb") as handle:
        pickle.dump(dataclasses.replace(now, strategy_state=dict(vars(strategy))), handle)
    resumed = _run(cfg.replace(rounds=2, resume=True))
    assert [record["round"] for record in resumed.history] == [0, 1, 2]
    assert not (tmp_path / PICKLE_FILE).exists()
