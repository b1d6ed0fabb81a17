"""A site on two hosts: a second `hydrafl site --node-rank 1` process joins the leader's rounds through torch's
elastic agent, and two hosts of two ranks train to the delta one host of four ranks reaches."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from spawned_ranks import SecondHostRankDiesOnFirstAttempt
from torch import nn

from hydrafl.data import load_cohort
from hydrafl.kernels.distributed import DistributedResult, train_distributed
from hydrafl.kernels.launch import free_port
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.kernels.multi_host import parse_endpoint
from hydrafl.models import federated_state

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def site() -> tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]]:
    split = load_cohort("tabular", num_sites=1, samples_per_site=64).sites[0]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(split.train_x.shape[1], 32),
        nn.Tanh(),
        nn.Linear(32, int(split.train_y.max()) + 1),
    )
    return split.train_x, split.train_y, functools.partial(copy.deepcopy, model)


def _train(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]], **overrides: object
) -> DistributedResult:
    x, y, build = site
    start = {name: t.clone() for name, t in federated_state(build()).items()}
    loss_fn = overrides.pop("loss_fn", None)
    training = LocalTraining(
        batch_size=8,
        lr=0.05,
        optimizer="sgd",
        seed=3,
        server_round=1,
        lanes=4,
        **overrides,  # type: ignore[arg-type]
    )
    extra = {"loss_fn": loss_fn} if loss_fn is not None else {}
    return train_distributed(build, start, x, y, training, device="cpu", **extra)  # type: ignore[arg-type]


@pytest.fixture
def second_host(tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Start `hydrafl site --nnodes 2 --node-rank 1` (the other host, here a process on loopback); the
    endpoint it joins."""
    started: list[subprocess.Popen] = []

    def start(*extra: str) -> str:
        endpoint = f"127.0.0.1:{free_port()}"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
            "HYDRAFL_TEST_SECOND_HOST": "1",
        }
        command = [sys.executable, "-m", "hydrafl", "site", "--nnodes", "2", "--node-rank", "1"]
        started.append(
            subprocess.Popen(
                [*command, "--rdzv", endpoint, "--nproc", "2", *extra],
                env=env,
                stdout=(tmp_path / "second-host.log").open("w"),
                stderr=subprocess.STDOUT,
            )
        )
        return endpoint

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=30)


@pytest.mark.slow
def test_two_hosts_of_two_ranks_train_to_the_one_host_delta_and_restart_a_rank_the_second_loses(
    site: tuple[torch.Tensor, torch.Tensor, Callable[[], nn.Module]],
    second_host: Callable[..., str],
) -> None:
    endpoint = second_host("--max-restarts", "1")
    one_host = _train(site, nproc=4)
    two_hosts = _train(site, nproc=2, nnodes=2, rdzv=endpoint, max_restarts=1)
    # the next round finds the other host waiting for it; one of its ranks dies in the first attempt
    restarted = _train(
        site,
        nproc=2,
        nnodes=2,
        rdzv=endpoint,
        max_restarts=1,
        loss_fn=SecondHostRankDiesOnFirstAttempt(),
    )
    assert (two_hosts.nproc, two_hosts.restarts, restarted.restarts) == (4, 0, 1)
    for result in (two_hosts, restarted):
        assert result.data_hash == one_host.data_hash
        assert result.loss == pytest.approx(one_host.loss, rel=1e-5)
        for name, tensor in one_host.end_state.items():
            torch.testing.assert_close(result.end_state[name], tensor, rtol=1e-5, atol=1e-7)
    start = site[2]().state_dict()
    moved = sum(float((one_host.end_state[k] - t).abs().sum()) for k, t in start.items())
    assert moved > 0.1  # the round trained: deltas that agree are not zero ones


def test_a_site_on_several_hosts_checks_its_flags_before_anything_starts() -> None:
    with pytest.raises(ValueError, match="rendezvous endpoint"):
        LocalTraining(batch_size=8, lr=0.1, nnodes=2)
    with pytest.raises(ValueError, match="not HOST:PORT"):
        parse_endpoint("somehost")
    run = functools.partial(
        subprocess.run,
        capture_output=True,
        text=True,
        timeout=60,
    )
    hydrafl = [sys.executable, "-m", "hydrafl", "site"]
    for args, said in (
        (["--nnodes", "2", "--node-rank", "1"], "--nnodes 2 needs --rdzv HOST:PORT"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv", "h:1"], "--node-rank 2 must be below"),
        (["--node-rank", "1"], "for a site on several hosts"),
        (["--nnodes", "2", "--node-rank", "1", "--rdzv", "h:99999"], "out of range"),
    ):
        done = run([*hydrafl, *args])
        assert done.returncode == 2, done.stderr
        assert said in " ".join((done.stdout + done.stderr).split())
