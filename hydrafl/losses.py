"""Each task's training objective as one `LossFn`: (model, x, y) -> the batch-mean loss, with a gradient.

The site trainer (in process and under DDP), the memory footprint probe and the Hydra layer/head scores all
call the same function, so a task's loss is defined once. The function always goes through the model's
`forward`: under DistributedDataParallel only what happens inside `forward` is seen by the gradient sync, so a
causal LM computes its chunked vocabulary loss there (`hydrafl.causal_lm.CausalLM`) when given `labels`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hydrafl.lora_pairs import lora_pairs, pruned_rank

LossFn = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]

__all__ = ["DistillationLoss", "LossFn", "classification_loss", "next_token_loss"]


def classification_loss(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `model(x)` (the `hydrafl.models.Classifier` interface), in float32 even when the
    logits come out of bf16 autocast."""
    return F.cross_entropy(model(x).float(), y)


def next_token_loss(model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the valid targets of y [B, T] (`hydrafl.causal_lm.CausalLM`)."""
    return model(x, labels=y)


@dataclass(frozen=True, slots=True)
class DistillationLoss:
    """CE + weight * KL(teacher || student) on every valid position. The teacher's signal is its final hidden
    states and LM head weight, never logits; picklable, so each DDP rank carries its own frozen teacher."""

    teacher: nn.Module
    """A frozen `hydrafl.causal_lm.CausalLM` (its `signal` gives hidden states [B, T, D_t] and head [V, D_t])."""
    weight: float

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        return model(x, labels=y, teacher=self.teacher.signal(x), distill_weight=self.weight)


@dataclass(frozen=True, slots=True)
class TailPenalised:
    """A HetLoRA site's loss: its task loss plus lambda * sum over adapted modules of ||B_tail A_tail||_F, the
    components of its rank a self-pruning step would drop. Picklable, so multi-process sites use it too."""

    loss: LossFn
    weight: float
    rank: int
    prune: float

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        value = self.loss(model, x, y)
        keep = pruned_rank(self.rank, self.prune)
        if keep >= self.rank or not self.weight:
            return value
        params = dict(model.named_parameters())
        tail = sum(
            _smooth_norm(params[p.b][:, keep : self.rank] @ params[p.a][keep : self.rank])
            for p in lora_pairs(params)
        )
        return value + self.weight * tail


def _smooth_norm(matrix: torch.Tensor) -> torch.Tensor:
    """||matrix||_F with a finite (zero) gradient at 0, where the tail of fresh adapters starts."""
    return torch.sqrt(matrix.square().sum() + 1e-12)
