"""Where layer streaming keeps a model's transformer blocks between uses (`LayerStore`: host memory, or one
safetensors file per block and kind on disk), and the parameter memory a round needs in memory or streamed
(`parameter_footprint`, checked against a site's budget by `check_memory_budget`).
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hydrafl.footprint import OPTIMIZER_STATES
from hydrafl.subnet.architecture import find_architecture

if TYPE_CHECKING:
    from hydrafl.kernels.local_training import LocalTraining

__all__ = [
    "STREAM_OFFLOADS",
    "Tensors",
    "DiskStore",
    "HostStore",
    "LayerStore",
    "MemoryBudgetError",
    "ParameterFootprint",
    "check_memory_budget",
    "check_stream_options",
    "open_store",
    "parameter_footprint",
]

STREAM_OFFLOADS = ("auto", "host", "disk")
"""Where streamed blocks live: auto (host memory beside an accelerator, disk on CPU), host, or disk."""

Tensors = dict[str, torch.Tensor]


class MemoryBudgetError(ValueError):
    """Training would hold more parameter memory (weights, gradients, optimizer state) than the site offers."""


class LayerStore:
    """Per block, named CPU tensors of four kinds: "frozen" and "trainable" weights, "grads", optimizer "state"."""

    def get(self, layer: int, kind: str) -> Tensors:
        raise NotImplementedError

    def put(self, layer: int, kind: str, tensors: Tensors) -> None:
        raise NotImplementedError

    def drop(self, layer: int, kind: str) -> None:
        raise NotImplementedError


class HostStore(LayerStore):
    """Blocks in host memory (pinned beside a CUDA device, so the window's copies run asynchronously)."""

    def __init__(self, *, pin: bool = False) -> None:
        self.pin = pin
        self._tensors: dict[tuple[int, str], Tensors] = {}

    def get(self, layer: int, kind: str) -> Tensors:
        return self._tensors.get((layer, kind), {})

    def put(self, layer: int, kind: str, tensors: Tensors) -> None:
        held = self._tensors.get((layer, kind), {})
        kept: Tensors = {}
        for name, tensor in tensors.items():
            old = held.get(name)
            if old is not None and old.shape == tensor.shape and old.dtype == tensor.dtype:
                kept[name] = old if old is tensor else old.copy_(tensor)
            else:
                copy = tensor.detach().to("cpu", copy=True)
                kept[name] = copy.pin_memory() if self.pin else copy
        self._tensors[(layer, kind)] = kept

    def drop(self, layer: int, kind: str) -> None:
        self._tensors.pop((layer, kind), None)


class DiskStore(LayerStore):
    """Blocks on disk, one safetensors file per block and kind; a read maps the file and copies out only that
    block's tensors, so nothing of a block is in memory outside the window."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def _path(self, layer: int, kind: str) -> Path:
        return self.folder / f"layer{layer:04d}.{kind}.safetensors"

    def get(self, layer: int, kind: str) -> Tensors:
        path = self._path(layer, kind)
        return load_file(path) if path.exists() else {}

    def put(self, layer: int, kind: str, tensors: Tensors) -> None:
        path = self._path(layer, kind)
        partial = path.with_suffix(".partial")
        save_file({n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}, partial)
        partial.replace(path)

    def drop(self, layer: int, kind: str) -> None:
        self._path(layer, kind).unlink(missing_ok=True)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParameterFootprint:
    """Parameter-side training memory (weights, gradients, optimizer state; activations excluded) in bytes."""

    outside_bytes: int
    """Everything outside the transformer blocks, with gradients and state for what trains there."""
    layer_bytes: tuple[int, ...]
    """Each computing block's weights, gradients and optimizer state."""
    bypassed_bytes: int = 0
    """The weights of blocks a Hydra spec bypasses: held in memory without streaming, never read with it."""

    @property
    def in_memory_bytes(self) -> int:
        return self.outside_bytes + sum(self.layer_bytes) + self.bypassed_bytes

    def streamed_bytes(self, window: int) -> int:
        """The most a window of `window` blocks can hold, plus what stays outside the blocks."""
        return self.outside_bytes + window * max(self.layer_bytes, default=0)


def parameter_footprint(model: nn.Module, optimizer: str) -> ParameterFootprint:
    """Weights + (1 + optimizer states) x trainable weights, outside the blocks and per computing block (what
    `LayerStream` materialises of a block: its weights, or in the update its trainable weights, gradients and
    state)."""
    arch = find_architecture(model)
    states = OPTIMIZER_STATES.get(optimizer, 2)
    layers = [0] * arch.num_layers
    outside = bypassed = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if p.requires_grad:  # a gradient, the states, and (Adam) a float32 step count per tensor
            size += size * (1 + states) + 4 * (states > 0)
        layer = arch.layer_of(name)
        if layer is None:
            outside += size
        elif "forward" in model.get_submodule(arch.layers[layer].name).__dict__:
            bypassed += p.numel() * p.element_size()
        else:
            layers[layer] += size
    return ParameterFootprint(
        outside_bytes=outside, layer_bytes=tuple(layers), bypassed_bytes=bypassed
    )


def check_memory_budget(
    model: nn.Module, optimizer: str, budget_bytes: int, window: int | None
) -> None:
    """Refuse, before training starts, a round whose parameter memory exceeds `budget_bytes` (0: no limit):
    the whole model's in memory (`window` None), the window's streamed."""
    if not budget_bytes:
        return
    footprint = parameter_footprint(model, optimizer)
    if window is None:
        need, fix = footprint.in_memory_bytes, "--stream-layers"
    else:
        need, fix = footprint.streamed_bytes(window), "a smaller --window"
    if need > budget_bytes:
        raise MemoryBudgetError(
            f"training needs {need / 1e6:.1f} MB of parameter memory, more than the "
            f"{budget_bytes / 1e6:.1f} MB budget; train with {fix}"
        )


def check_stream_options(training: LocalTraining) -> None:
    """A site's streaming options, checked where `LocalTraining` is built."""
    if training.window < 1 or training.memory_budget_bytes < 0:
        raise ValueError(
            f"window={training.window} must be >= 1 and memory_budget_bytes="
            f"{training.memory_budget_bytes} >= 0"
        )
    if training.stream_offload not in STREAM_OFFLOADS:
        raise ValueError(
            f"unknown stream_offload {training.stream_offload!r}; choose one of "
            f"{', '.join(STREAM_OFFLOADS)}"
        )
    if training.stream_layers and (training.world_size > 1 or training.optimizer == "lm-dual"):
        raise ValueError(
            "stream_layers trains one process with a gradient optimizer; use nproc=1 on one host and an "
            f"inner optimizer other than lm-dual (got {training.world_size} processes, "
            f"{training.optimizer})"
        )


@contextmanager
def open_store(offload: str, device: torch.device) -> Iterator[LayerStore]:
    """The store `offload` names ("auto": host memory beside an accelerator, a temporary folder on CPU)."""
    if offload == "host" or (offload == "auto" and device.type != "cpu"):
        yield HostStore(pin=device.type == "cuda")
        return
    with tempfile.TemporaryDirectory(prefix="hydrafl-stream-") as folder:
        yield DiskStore(Path(folder))
