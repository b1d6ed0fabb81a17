"""A training loss whose rank 1 dies on the first attempt: what a restart of the site's ranks must survive.
A module of its own so that the spawned ranks unpickle it importing little."""

from __future__ import annotations

import os

import torch
from torch import nn

from hydrafl.losses import classification_loss


class RankOneDiesOnFirstAttempt:
    """The task's loss, except that rank 1 of the first attempt kills its process mid-round (as an OOM kill
    would)."""

    def __call__(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
            os._exit(3)
        return classification_loss(model, x, y)
