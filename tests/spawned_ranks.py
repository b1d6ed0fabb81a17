"""What tests run inside spawned ranks. Spawned processes unpickle these by module name, so they live on the
tests' `pythonpath` (pytest's importlib mode names test modules in a way a child process cannot import), in a
module that imports little: losses that misbehave on purpose (a rank that dies, a round long enough to be
interrupted) and one rank of a vocabulary-sharded loss."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch import nn

from hydrafl.kernels.chunked_loss import (
    cross_entropy_from_stats,
    cross_entropy_shard_stats,
    gather_shard_stats,
    kl_from_stats,
    kl_shard_stats,
    merge_cross_entropy_stats,
    merge_kl_stats,
)
from hydrafl.losses import classification_loss


class RankOneDiesOnFirstAttempt:
    """The task's loss, except that rank 1 of the first attempt kills its process mid-round (as an OOM kill
    would)."""

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os._exit(3)
        return classification_loss(model, x, y)


class SlowLoss:
    """The task's loss, after `seconds` of sleep: a round that is still running when a signal comes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return classification_loss(model, x, y)


def vocab_sharded_rank(
    rank: int, port: int, out: str, problem: dict[str, torch.Tensor], split: tuple[int, ...]
) -> None:
    """One of len(split) - 1 gloo ranks, holding vocabulary ids [split[rank], split[rank + 1]) of the student's
    and the teacher's heads: CE + KL from the gathered stats; the gradients of its hidden states and of its
    head shard go to `out`/rank{rank}.pt."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=len(split) - 1)
    try:
        start, stop = split[rank], split[rank + 1]
        hidden = problem["hidden"].detach().clone().requires_grad_()
        weight = problem["weight"].detach()[start:stop].clone().requires_grad_()
        target, teacher = problem["target"], problem["teacher_weight"][start:stop]
        ce = cross_entropy_shard_stats(
            hidden, weight, target, vocab_start=start, chunk_size=16, window_size=8
        )
        kl = kl_shard_stats(hidden, weight, problem["teacher_hidden"], teacher, chunk_size=16)
        loss = cross_entropy_from_stats(
            merge_cross_entropy_stats(gather_shard_stats(ce)), target
        ) + kl_from_stats(merge_kl_stats(gather_shard_stats(kl)))
        loss.backward()
        torch.save(
            {"loss": loss.detach(), "hidden": hidden.grad, "weight": weight.grad},
            f"{out}/rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()


class SecondHostRankDiesOnFirstAttempt:
    """The task's loss, except that local rank 1 of the host started with $HYDRAFL_TEST_SECOND_HOST set kills
    its process in the first attempt (as an OOM kill on that host would)."""

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if (
            os.environ.get("HYDRAFL_TEST_SECOND_HOST")
            and os.environ["LOCAL_RANK"] == "1"
            and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
        ):
            os._exit(3)
        return classification_loss(model, x, y)
