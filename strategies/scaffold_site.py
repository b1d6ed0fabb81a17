"""SCAFFOLD's site half (Karimireddy et al., ICML 2020; as in Flower's baselines): the site keeps its control
variate c_i across rounds, corrects every local step by c - c_i and replies with the change of c_i.

A linear term <c - c_i, w> added to the loss adds exactly c - c_i to every gradient: the corrected step of
the paper, whatever the loss. After K local steps of rate eta from x to y, option II sets
c_i+ = c_i - c + (x - y) / (K eta), exact for plain SGD (the paper's inner optimizer; `--inner-optimizer sgd`).
c_i lives in the site's `Context.state`, which every runtime keeps per node across a run's messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from flwr.app import ArrayRecord
from torch import nn

from hydrafl.arrays import from_record, to_record
from hydrafl.strategies.registry import register_site
from hydrafl.strategies.site import LossFn, SiteHalf, Tensors, gradient_only, named_trainable

CONTROL = "scaffold.control"
"""The ArrayRecord of the server's control variate c in a train message, and of the change of c_i in a reply."""
SITE_CONTROL = "scaffold.site-control"
"""The site's own control variate c_i, in its `Context.state`."""


@dataclass(frozen=True, slots=True)
class Corrected:
    """The task loss plus <c - c_i, w> as a gradient-only term: each gradient gains c - c_i, the reported loss
    stays the task's. Picklable, so multi-process sites use it too."""

    loss: LossFn
    correction: dict[str, torch.Tensor]

    def __call__(self, model: nn.Module, x: Any, y: torch.Tensor) -> torch.Tensor:
        value = self.loss(model, x, y)
        pairs = [(p, self.correction[n]) for n, p in named_trainable(model) if n in self.correction]
        linear = sum((p * c.to(p.device)).sum() for p, c in pairs)
        return value + gradient_only(linear)  # type: ignore[arg-type]


@register_site("scaffold")
class ScaffoldSite(SiteHalf):
    reply_arrays = (CONTROL,)

    def loss(self, loss_fn: LossFn, start: Tensors) -> LossFn:
        server, own = self._controls(start)
        return Corrected(loss_fn, {name: server[name] - own[name] for name in start})

    def reply(
        self, start: Tensors, end: Tensors, steps: int, lr: float
    ) -> tuple[dict[str, ArrayRecord], dict[str, float]]:
        server, own = self._controls(start)
        updated = {n: own[n] - server[n] + (start[n] - end[n]) / (steps * lr) for n in start}
        self.state[SITE_CONTROL] = to_record(updated)
        return {CONTROL: to_record({n: updated[n] - own[n] for n in start})}, {}

    def _controls(self, start: Tensors) -> tuple[Tensors, Tensors]:
        """c as the message carries it and c_i as the site kept it (zero before its first round)."""
        if CONTROL not in self.arrays:
            raise ValueError(f"a SCAFFOLD train message carries the server's control {CONTROL!r}")
        server = from_record(self.arrays[CONTROL])
        kept = from_record(self.state[SITE_CONTROL]) if SITE_CONTROL in self.state else {}
        own = {name: kept.get(name, torch.zeros_like(t)) for name, t in start.items()}
        return server, own
