"""The site half of a strategy: what a strategy changes in a site's train round, beside the coordinator half
that aggregates (`hooks.py` lists both halves' hooks).

A site half is a `SiteHalf` subclass registered with `@register_site("name")` under its strategy's name, in a
module the site imports alone (`registry.site_half`): so it imports no coordinator code, and its model code
(losses, LoRA, subnetworks) only inside its hooks, since the coordinator imports it too to read `reply_arrays`.
The site app builds one per train message from the message's config and the site's `Context.state`, which
every runtime (the in-process grid, Ray, the site agent) keeps per node across a run's messages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from flwr.app import ArrayRecord, RecordDict
from torch import nn

if TYPE_CHECKING:
    from hydrafl.subnet.spec import SubnetSpec

LossFn = Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]
"""A training loss: (model, inputs, targets) -> scalar; picklable where sites train in several processes."""
Tensors = Mapping[str, torch.Tensor]


class SiteHalf:
    """Plain local training: the whole model, the run's local steps, the task's loss, the delta alone."""

    reply_arrays: ClassVar[tuple[str, ...]] = ()
    """ArrayRecords a train reply carries beside its delta, each over the delta's coordinates (SCAFFOLD's
    control variate change); the coordinator's reply check admits exactly these."""

    def __init__(
        self,
        config: Mapping[str, Any],
        state: RecordDict,
        arrays: Mapping[str, ArrayRecord] | None = None,
    ) -> None:
        self.config = config
        """The run's settings and the train message's keys (what the coordinator half added for this site)."""
        self.state = state
        """The site's `Context.state`: kept across the run's messages; a half keys its records by its name."""
        self.arrays = arrays or {}
        """The train message's ArrayRecords by key (the model, and what the coordinator half added)."""

    def subnet(self) -> SubnetSpec | None:
        """The subnetwork this site trains (Hydra-nets, the width baselines); None: every coordinate sent."""
        return None

    def lora_rank(self) -> int | None:
        """The LoRA rank this site trains (the LoRA baselines); None: the run's."""
        return None

    def local_steps(self, steps: int, samples: int, batch_size: int) -> int:
        """How many local steps this round takes: the run's `steps` unless the strategy sizes the work by data."""
        return steps

    def loss(self, loss_fn: LossFn, start: Tensors) -> LossFn:
        """The loss the site trains on, given the task's and the round's start weights."""
        return loss_fn

    def reply(
        self, start: Tensors, end: Tensors, steps: int, lr: float
    ) -> tuple[dict[str, ArrayRecord], dict[str, float]]:
        """What the reply carries beside the delta: the records `reply_arrays` names and extra metrics; the
        place to keep state for the next round (`self.state`)."""
        return {}, {}


def gradient_only(term: torch.Tensor) -> torch.Tensor:
    """`term` with value 0 and its own gradient: added to a loss it steers the step and leaves the reported
    training loss the task's (FedProx's and SCAFFOLD's terms are not part of the model's loss)."""
    return term - term.detach()


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a local step moves, by their names in the unwrapped model (DDP prefixes `module.`)."""
    return [
        (name.removeprefix("module."), p) for name, p in model.named_parameters() if p.requires_grad
    ]
