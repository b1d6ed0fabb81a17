"""The local trainer a site runs for one round, and its evaluation.

Batch order is a pure function of (seed, round, site), never of global RNG state, so a resumed run and an
uninterrupted run train on exactly the same batches.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hydrafl.kernels.optimizers import build_inner_optimizer


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTrainConfig:
    steps: int
    batch_size: int
    lr: float
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    """FedProx: adds mu/2 ||w - w_global||^2 to the loss."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainResult:
    loss: float
    """Mean training loss over the local steps."""
    num_examples: int
    """Samples seen this round (steps x batch size); what FedAvg-style weighting uses."""


def batch_generator(seed: int, server_round: int, site: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + server_round * 10_007 + site)


def batch_indices(num_samples: int, config: LocalTrainConfig, generator: torch.Generator) -> list[torch.Tensor]:
    """Indices of each local step's batch: shuffled epochs, concatenated, cut into batches."""
    needed = config.steps * config.batch_size
    order = torch.cat([torch.randperm(num_samples, generator=generator) for _ in range(-(-needed // num_samples))])
    return list(order[:needed].view(config.steps, config.batch_size))


def train_local(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, config: LocalTrainConfig, generator: torch.Generator
) -> TrainResult:
    """Run `config.steps` optimizer steps on (x, y); the model is updated in place."""
    config = dataclasses.replace(config, batch_size=min(config.batch_size, len(x)))
    optimizer = build_inner_optimizer(model, config.optimizer, lr=config.lr, weight_decay=config.weight_decay)
    anchors = [p.detach().clone() for p in model.parameters() if p.requires_grad] if config.proximal_mu else []
    model.train()
    total = 0.0
    for idx in batch_indices(len(x), config, generator):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x[idx]), y[idx])
        total += loss.item()
        if config.proximal_mu:
            trainable = (p for p in model.parameters() if p.requires_grad)
            proximal = sum(((p - a) ** 2).sum() for p, a in zip(trainable, anchors, strict=True))
            loss = loss + 0.5 * config.proximal_mu * proximal
        loss.backward()
        optimizer.step()
    return TrainResult(loss=total / config.steps, num_examples=config.steps * config.batch_size)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on (x, y)."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss_sum += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(dim=-1) == target).sum())
    return loss_sum / len(x), correct / len(x)
