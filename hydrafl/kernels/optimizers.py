"""Inner optimizers a site runs between two synchronisations.

Muon only makes sense for hidden 2-D weight matrices; embeddings, the classifier head and 1-D
parameters (norms, biases) stay on AdamW, as in the Muon and MuLoCo recipes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

INNER_OPTIMIZERS = ("adamw", "sgd", "muon")


class InnerOptimizer:
    """A few torch optimizers stepped together, so Muon + AdamW looks like one optimizer to the trainer."""

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        self.optimizers = list(optimizers)

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


def _is_muon_matrix(name: str, param: nn.Parameter) -> bool:
    lowered = name.lower()
    return param.ndim == 2 and not any(key in lowered for key in ("embed", "classifier", "head", "feature_"))


def build_inner_optimizer(model: nn.Module, name: str, *, lr: float, weight_decay: float = 0.0) -> InnerOptimizer:
    """Build the inner optimizer `name` (adamw, sgd or muon) over the model's trainable parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if name == "adamw":
        return InnerOptimizer([torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay)])
    if name == "sgd":
        return InnerOptimizer([torch.optim.SGD([p for _, p in named], lr=lr, weight_decay=weight_decay)])
    if name == "muon":
        matrices = [p for n, p in named if _is_muon_matrix(n, p)]
        others = [p for n, p in named if not _is_muon_matrix(n, p)]
        optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            optimizers.append(
                torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
            )
        if others:
            optimizers.append(torch.optim.AdamW(others, lr=lr, weight_decay=weight_decay))
        return InnerOptimizer(optimizers)
    raise ValueError(f"unknown inner optimizer {name!r}; choose one of {', '.join(INNER_OPTIMIZERS)}")
