"""FedProx's site half: the proximal term mu/2 ||w - w_global||^2 joins the local loss, mu read from the
"proximal-mu" key Flower's FedProx puts in every train message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hydrafl.strategies.registry import register_site
from hydrafl.strategies.site import LossFn, SiteHalf, Tensors, gradient_only, named_trainable

PROXIMAL_MU = "proximal-mu"
"""Flower's FedProx's own config key."""


@dataclass(frozen=True, slots=True)
class Proximal:
    """The task loss plus mu/2 ||w - w0||^2 over the trainable parameters (`w0`: the round's start), as a
    gradient-only term: the reported loss stays the task's. Picklable, so multi-process sites use it too."""

    loss: LossFn
    mu: float
    anchors: dict[str, torch.Tensor]

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        value = self.loss(model, x, y)
        pairs = [(p, self.anchors[n]) for n, p in named_trainable(model) if n in self.anchors]
        drift = sum(((p - a.to(p.device)) ** 2).sum() for p, a in pairs)
        return value + 0.5 * self.mu * gradient_only(drift)  # type: ignore[arg-type]


@register_site("fedprox")
class FedProxSite(SiteHalf):
    def loss(self, loss_fn: LossFn, start: Tensors) -> LossFn:
        mu = float(self.config.get(PROXIMAL_MU, 0.0))  # type: ignore[arg-type]
        if mu < 0:
            raise ValueError(f"{PROXIMAL_MU}={mu} must be >= 0")
        return Proximal(loss_fn, mu, dict(start)) if mu else loss_fn
