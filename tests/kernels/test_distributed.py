"""Multi-process site training: 2 gloo ranks under DDP train to the state 1 process reaches on the same batches."""

from __future__ import annotations

import copy
import functools
import math
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from spawned_ranks import RankOneDiesOnFirstAttempt, SlowLoss
from torch import nn

from hydrafl.data import load_cohort
from hydrafl.kernels import distributed
from hydrafl.kernels.distributed import (
    DistributedResult,
    DistributedTrainingError,
    pick_device,
    process_group_backend,
    train_distributed,
)
from hydrafl.kernels.elastic_loader import (
    ElasticLoader,
    WorldSizeError,
    hash_global_batches,
    round_order,
)
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.kernels.optimizers import build_inner_optimizer
from hydrafl.models import TinyShape, build_model, federated_state

LANES = 4
GLOBAL_BATCH = 8
TINY = TinyShape(hidden=16, layers=1, heads=2, intermediate=32)


@pytest.fixture(scope="module")
def site() -> tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]]:
    cohort = load_cohort("tabular", num_sites=1, samples_per_site=64)
    split = cohort.sites[0]
    return split.train_x, split.train_y, functools.partial(build_model, cohort.task, shape=TINY)


def _mlp_builder(num_features: int, num_classes: int) -> Callable[[], nn.Module]:
    """A picklable builder whose spawned ranks import only torch (fast start-up on a busy CI machine)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(num_features, 32),
        nn.Tanh(),
        nn.Linear(32, 32),
        nn.GELU(),
        nn.Linear(32, num_classes),
    )
    return functools.partial(copy.deepcopy, model)


def _start_state(build: Callable[[], nn.Module]) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in federated_state(build()).items()}


def _relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over all tensors flattened together (float64)."""
    diff = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    norm = sum(float(a[k].double().pow(2).sum()) for k in a)
    return math.sqrt(diff / norm)


def _delta(end: dict[str, torch.Tensor], start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: end[k] - start[k] for k in start}


def _run(
    build: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, **overrides: object
) -> DistributedResult:
    kwargs: dict[str, object] = {
        "batch_size": GLOBAL_BATCH,
        "lr": 1e-2,
        "optimizer": "sgd",
        "seed": 3,
        "server_round": 1,
        "nproc": 1,
        "lanes": LANES,
    }
    kwargs.update(overrides)
    runtime = {key: kwargs.pop(key) for key in ("device", "loss_fn") if key in kwargs}
    training = LocalTraining(**kwargs)  # type: ignore[arg-type]
    return train_distributed(build, _start_state(build), x, y, training, **runtime)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def mlp_runs(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
) -> dict[tuple[str, int], object]:
    """1- and 2-process runs of an MLP for SGD and AdamW, by (optimizer, nproc), and the start state under "start".
    Each run is made once, when a test first asks for it (the spawns are the slow part)."""
    x, y, _ = site
    build = _mlp_builder(x.shape[1], int(y.max()) + 1)

    class Runs(dict):
        def __missing__(self, key: tuple[str, int]) -> DistributedResult:
            optimizer, nproc = key
            self[key] = _run(build, x, y, optimizer=optimizer, nproc=nproc, lr=0.05)
            return self[key]

    return Runs(start=_start_state(build))


def test_pick_device_falls_back_to_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert pick_device() == torch.device("cpu")
    assert process_group_backend(pick_device()) == "gloo"


def test_pick_device_uses_the_current_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    assert pick_device() == torch.device("cuda")
    assert process_group_backend(pick_device()) == "nccl"


def test_one_process_runs_in_process_and_is_the_plain_loop(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y, build = site

    def no_launch(*args: object, **kwargs: object) -> None:
        raise AssertionError("nproc=1 must not start processes")

    monkeypatch.setattr(distributed, "elastic_run", no_launch)
    result = _run(build, x, y, optimizer="adamw", steps=3)

    # The reference: a plain loop over the round's first three global batches, mean loss over each.
    model = build()
    optimizer = build_inner_optimizer(model, "adamw", lr=1e-2)
    loader = ElasticLoader(
        len(x), global_batch_size=GLOBAL_BATCH, lanes=LANES, seed=3, server_round=1
    )
    losses = []
    for step in range(3):
        idx = torch.as_tensor(loader.global_batch(step))
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    expected = federated_state(model)
    assert result.end_state.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(result.end_state[name], tensor, rtol=0, atol=0)
    assert result.loss == pytest.approx(sum(losses) / 3, rel=1e-12)
    assert (result.samples, result.steps, result.nproc, result.device) == (
        3 * GLOBAL_BATCH,
        3,
        1,
        "cpu",
    )
    assert result.samples_per_s > 0


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_two_gloo_processes_equal_one_process(mlp_runs: dict, optimizer: str) -> None:
    one, two = mlp_runs[optimizer, 1], mlp_runs[optimizer, 2]
    start = mlp_runs["start"]
    assert (
        two.nproc == 2 and two.samples == one.samples == 6 * GLOBAL_BATCH
    )  # 51 train rows: 6 full batches
    assert _relative_difference(one.end_state, two.end_state) <= 1e-5
    # The pseudo-gradient a site sends (end - start) agrees too, not just the (large) weights.
    assert _relative_difference(_delta(one.end_state, start), _delta(two.end_state, start)) <= 1e-4
    assert (
        _relative_difference(
            _delta(one.end_state, start), {k: torch.zeros_like(v) for k, v in start.items()}
        )
        > 0
    )
    assert two.loss == pytest.approx(one.loss, rel=1e-5)


@pytest.mark.slow
def test_a_dead_rank_is_restarted_and_the_round_replayed_to_the_same_delta(
    mlp_runs: dict, site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]]
) -> None:
    x, y, _ = site
    build = _mlp_builder(x.shape[1], int(y.max()) + 1)
    undisturbed = mlp_runs["sgd", 2]
    restarted = _run(
        build, x, y, nproc=2, lr=0.05, loss_fn=RankOneDiesOnFirstAttempt(), max_restarts=1
    )
    assert (undisturbed.restarts, restarted.restarts) == (0, 1)
    for name, tensor in undisturbed.end_state.items():
        torch.testing.assert_close(restarted.end_state[name], tensor, rtol=0, atol=0)
    assert (restarted.loss, restarted.data_hash) == (undisturbed.loss, undisturbed.data_hash)
    with pytest.raises(
        DistributedTrainingError, match="2 training processes failed after 0 restart"
    ):
        _run(build, x, y, nproc=2, lr=0.05, loss_fn=RankOneDiesOnFirstAttempt())


@pytest.mark.slow
def test_a_launch_leaves_the_process_its_signal_handlers_and_ctrl_c_stops_it(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The elastic agent installs its own handlers and leaves them: a site would take Ctrl-C for a failed round.
    It also writes worker logs, which must go with the round."""
    x, y, _ = site
    build = _mlp_builder(x.shape[1], int(y.max()) + 1)
    monkeypatch.setattr(
        tempfile, "tempdir", str(tmp_path)
    )  # where the launch and the agent put their files

    def state() -> tuple[dict, list]:
        return {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}, list(
            tmp_path.iterdir()
        )

    before = state()
    _run(build, x, y, nproc=2, lr=0.05, steps=1)
    assert state() == before
    interrupt = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    interrupt.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(
                build, x, y, nproc=2, lr=0.05, steps=6, loss_fn=SlowLoss(5.0)
            )  # 30 s: the signal comes first
    finally:
        interrupt.cancel()
    assert state() == before


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_data_hash_is_the_same_for_any_nproc(
    mlp_runs: dict, site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]], nproc: int
) -> None:
    x, _, _ = site
    order = round_order(len(x), 3, 1)
    expected = hash_global_batches(
        order[k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH] for k in range(6)
    )
    assert mlp_runs["sgd", nproc].data_hash == mlp_runs["adamw", nproc].data_hash == expected


def test_data_hash_changes_with_the_round_and_the_steps(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
) -> None:
    x, y, build = site
    assert (
        _run(build, x, y, server_round=2, steps=1).data_hash != _run(build, x, y, steps=1).data_hash
    )
    assert _run(build, x, y, steps=2).data_hash != _run(build, x, y, steps=1).data_hash


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_steps_beyond_one_pass_read_further_passes_identically_for_any_nproc(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]], nproc: int
) -> None:
    """51 rows hold 6 global batches of 8 per pass: 9 steps read all of pass 0 and 3 batches of pass 1."""
    x, y, _ = site
    build = _mlp_builder(x.shape[1], int(y.max()) + 1)
    start = _start_state(build)
    one, other = _run(build, x, y, steps=9), _run(build, x, y, steps=9, nproc=nproc)
    passes = [round_order(len(x), 3, 1, epoch) for epoch in (0, 1)]
    batches = [passes[0][k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH] for k in range(6)]
    batches += [passes[1][k * GLOBAL_BATCH : (k + 1) * GLOBAL_BATCH] for k in range(3)]
    assert one.data_hash == other.data_hash == hash_global_batches(batches)
    assert one.samples == other.samples == 9 * GLOBAL_BATCH
    assert (
        _relative_difference(_delta(one.end_state, start), _delta(other.end_state, start)) <= 1e-4
    )


def test_nproc_beyond_the_lanes_is_an_error_before_any_spawn(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y, build = site
    monkeypatch.setattr(
        distributed,
        "elastic_run",
        lambda *a, **k: pytest.fail("launched despite a bad world size"),
    )
    with pytest.raises(WorldSizeError, match="between 1 and the number of lanes 4"):
        _run(build, x, y, nproc=5)
    with pytest.raises(WorldSizeError, match="do not divide evenly"):
        _run(build, x, y, nproc=3)
    with pytest.raises(ValueError, match="steps=0"):
        _run(build, x, y, steps=0)
    with pytest.raises(ValueError, match="nproc=0"):
        _run(build, x, y, nproc=0)


def test_start_state_missing_a_trainable_parameter_is_an_error(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
) -> None:
    x, y, build = site
    state = _start_state(build)
    state.pop("net.head.weight")
    with pytest.raises(KeyError, match="net.head.weight"):
        train_distributed(
            build,
            state,
            x,
            y,
            LocalTraining(batch_size=GLOBAL_BATCH, lr=1e-2, lanes=LANES, steps=1),
        )


def test_bf16_autocast_runs_with_a_finite_loss(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
) -> None:
    x, y, build = site
    result = _run(build, x, y, bf16=True, steps=2, optimizer="adamw")
    assert math.isfinite(result.loss)
    assert all(tensor.dtype == torch.float32 for tensor in result.end_state.values())


@pytest.mark.slow
def test_two_processes_equal_one_process_on_the_tabular_transformer(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
) -> None:
    """build_model's encoder (with a never-used word embedding: DDP must tolerate unused parameters).

    The attention key biases are left out: softmax is shift-invariant, so their true gradient is exactly zero and
    what they get is fp32 rounding noise, which depends on the reduction order (1 vs 2 ranks). AdamW normalises
    that noise into real steps (up to ~lr |g| / (|g| + eps)), so those coordinates legitimately differ.
    """
    x, y, build = site
    start = _start_state(build)
    one = _run(build, x, y, optimizer="adamw")
    two = _run(build, x, y, optimizer="adamw", nproc=2)

    def determined(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in state.items() if not k.endswith("attention.self.key.bias")}

    assert len(determined(start)) == len(start) - TINY.layers
    assert _relative_difference(determined(one.end_state), determined(two.end_state)) <= 1e-5
    one_delta, two_delta = _delta(one.end_state, start), _delta(two.end_state, start)
    assert _relative_difference(determined(one_delta), determined(two_delta)) <= 1e-4
    assert one.data_hash == two.data_hash
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
