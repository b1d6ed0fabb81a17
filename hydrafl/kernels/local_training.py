"""A site's local training for one round, as one statement: from the ClientApp (or the simulation) down to each
rank, over one process, several, several hosts, or layers streamed through the device."""

from __future__ import annotations

from dataclasses import dataclass

from hydrafl.catalog import INNER_OPTIMIZERS
from hydrafl.kernels.layer_store import check_stream_options

__all__ = ["LocalTraining"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LocalTraining:
    """One round of a site's local training, however many processes run it: the one statement of a site's
    training parameters, from the ClientApp to each rank."""

    steps: int | None = None
    """Global batches to train on; None: every full global batch of one pass."""
    batch_size: int
    """The global batch (over all processes); it must split evenly over `nproc` and the `lanes`."""
    lr: float
    optimizer: str = "adamw"
    weight_decay: float = 0.0
    seed: int = 0
    """Data-order seed (`hydrafl.client.training.site_seed` gives each site its own)."""
    server_round: int = 0
    nproc: int = 1
    """Training processes (one per accelerator, or CPU ranks under gloo)."""
    lanes: int = 8
    """The loader's lanes: nproc must divide them (the global batches do not depend on them)."""
    bf16: bool = False
    """Train under bfloat16 autocast."""
    max_restarts: int = 0
    """With nproc > 1: how often the ranks are restarted (the round replayed) when one dies."""
    threads: int = 0
    """Torch threads the site trains with, over all its processes; 0: the machine's cores. A site sharing its
    machine with others takes its share (`hydrafl.client.machine_share`)."""
    nnodes: int = 1
    """Hosts the site trains on, `nproc` processes each (`hydrafl.kernels.multi_host`)."""
    rdzv: str = ""
    """With nnodes > 1: HOST:PORT of the site's rendezvous store, which this (the leader's) process hosts."""

    stream_layers: bool = False
    """Keep the transformer blocks off the compute device (`kernels.layer_stream`) and stream a window of them
    through it: for a model whose weights and optimizer state do not fit."""
    window: int = 2
    """With stream_layers: blocks materialised at once (the one computing and those read ahead)."""
    stream_offload: str = "auto"
    """With stream_layers: where the blocks live, one of `layer_store.STREAM_OFFLOADS`."""
    memory_budget_bytes: int = 0
    """Parameter memory the site offers (weights, gradients, optimizer state); a round that needs more is
    refused before it starts (`layer_store.check_memory_budget`). 0: no limit."""

    @property
    def world_size(self) -> int:
        """Training processes over all the site's hosts."""
        return self.nproc * self.nnodes

    def __post_init__(self) -> None:
        if (
            (self.steps is not None and self.steps < 1)
            or self.batch_size < 1
            or self.nproc < 1
            or self.nnodes < 1
        ):
            raise ValueError(
                f"steps={self.steps}, batch_size={self.batch_size}, nproc={self.nproc} and "
                f"nnodes={self.nnodes} must be >= 1"
            )
        if self.nnodes > 1 and not self.rdzv:
            raise ValueError(
                "training on several hosts needs the site's rendezvous endpoint (rdzv)"
            )
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts={self.max_restarts} must be >= 0")
        if self.optimizer not in INNER_OPTIMIZERS:
            raise ValueError(
                f"unknown inner optimizer {self.optimizer!r}; choose one of "
                f"{', '.join(INNER_OPTIMIZERS)}"
            )
        if self.optimizer == "lm-dual" and self.world_size > 1:
            raise ValueError("lm-dual fine-tunes the head in one process; use nproc=1 on one host")
        check_stream_options(self)
