"""Each task's training objective as one `LossFn`: (model, x, y) -> the batch-mean loss, with a gradient.

The site trainer (in process and under DDP), the memory footprint probe and the Hydra layer/head scores all
call the same function, so a task's loss is defined once. The function always goes through the model's
`forward`: under DistributedDataParallel only what happens inside `forward` is seen by the gradient sync, so a
causal LM computes its chunked vocabulary loss there (`hydrafl.models.CausalLM`) when given `labels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LossFn = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]

__all__ = ["DistillationLoss", "LossFn", "classification_loss", "next_token_loss"]


def classification_loss(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model(x)` (the `hydrafl.models.Classifier` interface), in float32 even when the
    logits come out of bf16 autocast."""
    return F.cross_entropy(model(x).float(), y)


def next_token_loss(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid targets of y [B, T] (`hydrafl.models.CausalLM`)."""
    return model(x, labels=y)


@dataclass(frozen=True, slots=True)
class DistillationLoss:
    """CE + weight * KL(teacher || student) on every valid position. The teacher's signal is its final hidden
    states and LM head weight, never logits; picklable, so each DDP rank carries its own frozen teacher."""

    teacher: nn.Module
    """A frozen `hydrafl.models.CausalLM` (its `signal` gives hidden states [B, T, D_t] and head [V, D_t])."""
    weight: float

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        return model(x, labels=y, teacher=self.teacher.signal(x), distill_weight=self.weight)
