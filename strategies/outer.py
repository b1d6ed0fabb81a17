"""The outer optimizer DiLoCo and Hydra share: SGD with (Nesterov) momentum over a pseudo-gradient, in
torch.optim.SGD's convention, per named tensor; a masked step leaves untouched coordinates and their momentum
as they were."""

from __future__ import annotations

from typing import Any

import torch


class OuterOptimizer:
    """lr 1 without momentum is the plain mean update (no outer optimizer). Its settings come from the
    strategy's config (`diloco.OuterConfig` and the like), where their defaults are written once."""

    def __init__(self, *, lr: float, momentum: float, nesterov: bool) -> None:
        if lr <= 0 or not 0 <= momentum < 1:
            raise ValueError(
                f"the outer optimizer needs lr > 0 and 0 <= momentum < 1, got {lr=}, {momentum=}"
            )
        self.lr, self.momentum, self.nesterov = lr, momentum, nesterov
        self.momentum_buffer: dict[str, torch.Tensor] = {}

    def direction(self, name: str, delta: torch.Tensor) -> torch.Tensor:
        """b = mu b + d; the step goes along d + mu b (Nesterov) or b (heavy ball)."""
        if not self.momentum:
            return delta
        buffer = self.momentum_buffer.get(name)
        buffer = delta.clone() if buffer is None else buffer.mul_(self.momentum).add_(delta)
        self.momentum_buffer[name] = buffer
        return delta + self.momentum * buffer if self.nesterov else buffer

    def step(self, name: str, weights: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return weights - self.lr * self.direction(name, delta)

    def masked_step(
        self, name: str, weights: torch.Tensor, delta: torch.Tensor, trained: torch.Tensor
    ) -> torch.Tensor:
        """The step where `trained`; elsewhere value and momentum stay as they were."""
        before = self.momentum_buffer[name].clone() if name in self.momentum_buffer else None
        direction = self.direction(name, delta)
        if before is not None:
            self.momentum_buffer[name] = torch.where(trained, self.momentum_buffer[name], before)
        return torch.where(trained, weights - self.lr * direction, weights)

    def state_dict(self) -> dict[str, Any]:
        return {"momentum_buffer": {name: t.clone() for name, t in self.momentum_buffer.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.momentum_buffer = {name: t.clone() for name, t in state["momentum_buffer"].items()}
