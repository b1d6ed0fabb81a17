"""The part of each tensor a subnetwork trains or reads (`Slice`), and moving exactly those coordinates: cut out
(`extract`), put back (`merge`), counted (`payload_bytes`), masked (`coordinate_masks`).

Both sides use it: the site slices its live model's tensors, the coordinator slices the global arrays from the
layout a site reported (`layout_slices`), without any model code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from hydrafl.subnet.families import is_expert_tensor
from hydrafl.subnet.spec import SubnetSpec

Layout = Mapping[str, tuple[int, int, int]]
"""Per federated tensor: (layer or -1, head axis or -1, indices one head group owns along it), as a site reports
it (`site_app.slice_layout`)."""


@dataclass(frozen=True)
class Slice:
    """The part of one tensor a subnetwork trains: the whole tensor (dim None) or `index` along `dim`."""

    dim: int | None
    index: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "index", tuple(int(i) for i in self.index))

    @cached_property
    def _index(self) -> torch.Tensor:
        return torch.tensor(self.index, dtype=torch.long)

    def numel(self, shape: Sequence[int]) -> int:
        if self.dim is None:
            return math.prod(shape)
        return len(self.index) * math.prod(shape) // shape[self.dim]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A compact copy of the slice (same dtype)."""
        tensor = tensor.detach()
        if self.dim is None:
            return tensor.clone()
        return tensor.index_select(self.dim, self._index.to(tensor.device))

    def taken_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The shape `take` gives for a tensor of `shape`: what a site uploads for it."""
        taken = list(shape)
        if self.dim is not None:
            taken[self.dim] = len(self.index)
        return tuple(taken)

    def put(self, tensor: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """A copy of `tensor` with the slice replaced by `values` (shape of `take(tensor)`)."""
        expected = self.taken_shape(tensor.shape)
        if tuple(values.shape) != expected:
            raise ValueError(f"slice values have shape {tuple(values.shape)}, expected {expected}")
        values = values.detach().to(dtype=tensor.dtype, device=tensor.device)
        if self.dim is None:
            return values.clone()
        return tensor.detach().clone().index_copy_(self.dim, self._index.to(tensor.device), values)

    def add_to(self, target: torch.Tensor, values: torch.Tensor, alpha: float = 1.0) -> None:
        """target[slice] += alpha * values, in place (`values` of `take`'s shape): aggregation without ever
        expanding a compact upload to the full tensor."""
        if self.dim is None:
            target.add_(values, alpha=alpha)
        else:
            target.index_add_(
                self.dim, self._index.to(target.device), values.to(target.dtype), alpha=alpha
            )

    def mask(self, shape: Sequence[int]) -> torch.Tensor:
        """Boolean tensor of `shape`, True on the sliced coordinates (m_kj of the masked aggregation)."""
        if self.dim is None:
            return torch.ones(tuple(shape), dtype=torch.bool)
        return torch.zeros(tuple(shape), dtype=torch.bool).index_fill_(self.dim, self._index, True)


def expert_slice(spec: SubnetSpec, layer: int) -> Slice:
    """The rows of an expert tensor (`families.EXPERT_TENSORS`, expert on axis 0) a selected layer trains."""
    kept = spec.experts_for(layer)
    return Slice(None) if kept is None else Slice(0, kept)


def layout_slices(layout: Layout, spec: SubnetSpec) -> dict[str, Slice]:
    """`subnet.apply.trainable_slices` of `spec`, from the layout a site reported instead of a live model."""
    slices = {}
    for name, (layer, axis, unit) in layout.items():
        if layer < 0:
            if spec.train_outside:
                slices[name] = Slice(None)
        elif layer in spec.layers and is_expert_tensor(name):
            slices[name] = expert_slice(spec, layer)
        elif layer in spec.layers:
            kept = spec.heads_for(layer)
            whole = axis < 0 or kept is None
            slices[name] = (
                Slice(None)
                if whole
                else Slice(axis, [i for g in kept for i in range(g * unit, (g + 1) * unit)])
            )
    return slices


def read_slices(
    trained: Mapping[str, Slice], layers: Mapping[str, int], spec: SubnetSpec
) -> dict[str, Slice]:
    """The coordinates a subnetwork's forward pass reads, which is all a site has to download: what it trains
    (`trained`, from `trainable_slices` or the coordinator's layout), and every other federated tensor whole
    (`layers`: per name its layer, -1 outside the layers) except those of the layers `spec.bypass` skips.
    Dropped heads and widths are outside it: `apply_spec` zeroes their outputs before anything uses them
    (unless `spec.freeze_heads` keeps them running: then every read tensor is whole). Experts a site does not
    train still run, so expert tensors are read whole.
    The coordinator and the site both compute it, so it depends on nothing but these arguments."""
    return {
        name: Slice(None)
        if spec.freeze_heads or is_expert_tensor(name)
        else trained.get(name, Slice(None))
        for name, layer in layers.items()
        if name in trained or not (spec.bypass and layer >= 0 and layer not in spec.layers)
    }


def extract(
    state: Mapping[str, torch.Tensor], slices: Mapping[str, Slice]
) -> dict[str, torch.Tensor]:
    """The sliced coordinates of `state`, one compact tensor per name (same dtype)."""
    missing = [name for name in slices if name not in state]
    if missing:
        raise KeyError(f"state lacks {len(missing)} sliced tensors, e.g. {missing[:3]}")
    return {name: sl.take(state[name]) for name, sl in slices.items()}


def merge(
    base: Mapping[str, torch.Tensor],
    slices: Mapping[str, Slice],
    extracted: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """`base` with every slice overwritten by `extracted` (new tensors for those names; others shared)."""
    out = dict(base)
    for name, sl in slices.items():
        if name not in extracted:
            raise KeyError(f"extracted payload lacks {name!r}")
        if name not in base:
            raise KeyError(f"base state lacks {name!r}")
        out[name] = sl.put(base[name], extracted[name])
    return out


def payload_bytes(extracted: Mapping[str, torch.Tensor]) -> int:
    """Bytes of the tensor data in an extracted payload (before any transport framing)."""
    return sum(t.numel() * t.element_size() for t in extracted.values())


def coordinate_masks(
    slices: Mapping[str, Slice], state: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Full-shape boolean masks of the sliced coordinates (for masked per-coordinate aggregation)."""
    return {name: sl.mask(state[name].shape) for name, sl in slices.items()}


__all__ = [
    "Layout",
    "Slice",
    "coordinate_masks",
    "expert_slice",
    "extract",
    "layout_slices",
    "merge",
    "payload_bytes",
    "read_slices",
]
