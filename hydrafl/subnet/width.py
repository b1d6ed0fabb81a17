"""Width slicing for the width-based baselines (HeteroFL, FjORD, FedRolex), as pure index arithmetic.

A width ratio r keeps, in every selected layer, ceil(r * d) of the d dims of EVERY attention head (rows of q/k/v
and of their LoRA B, the matching columns of o and of its LoRA A) and ceil(r * I) of the I FFN hidden units
(rows of the FFN input projections, columns of the output projection). The residual stream (embeddings, norms,
the o and FFN output biases, the classifier) stays whole and every site trains it: zeroing residual channels
would still let LayerNorm write into them, so masking cannot give HeteroFL's narrower residual stream.
Along a width axis a tensor is a run of blocks of `period` channels (one per head, or the whole FFN); every
block keeps the same window.

The coordinator computes widths from the layout a site reported; the site's hooks (`subnet.apply`) use the same
windows on its live model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from hydrafl.subnet.families import FFN_PATTERNS, projection_axis
from hydrafl.subnet.slices import Slice
from hydrafl.subnet.spec import SpecError, SubnetSpec


class WidthAxis(NamedTuple):
    """How one federated tensor is width-sliced."""

    layer: int  # -1 outside the layers
    axis: int  # -1 when the tensor is not width-sliced
    period: int  # channels per block along `axis`: the head dim, or the FFN hidden units
    shape: tuple[int, ...]


WidthLayout = Mapping[str, WidthAxis]
"""Per federated tensor name, how it is width-sliced."""


def width_window(period: int, ratio: float, offset: int = 0) -> tuple[int, ...]:
    """The ceil(ratio * period) channels of a block a width keeps, from `offset mod period` on, wrapping around
    (FedRolex); offset 0 is the leading slice of HeteroFL and FjORD. Sorted."""
    keep = min(period, max(1, math.ceil(ratio * period - 1e-9)))
    return tuple(sorted((offset + i) % period for i in range(keep)))


def ffn_width_axis(name: str, layer: int) -> int | None:
    """Width axis of an FFN tensor of `layer`: projections into the hidden units are sliced like q/k/v (rows),
    the projection out of them like o (columns); None for any other tensor."""
    for inputs, output in FFN_PATTERNS.values():
        for role, module in [*(("q", m) for m in inputs), ("o", output)]:
            marker = f".{layer}.{module}."
            if marker in f".{name}":
                suffix = f".{name}".split(marker, 1)[1]
                return projection_axis(role, suffix)
    return None


def width_layout_from_heads(
    layout: Mapping[str, tuple[int, int, int]], shapes: Mapping[str, Sequence[int]]
) -> dict[str, WidthAxis]:
    """Coordinator side, without the model: `width_layout` from the head layout a site reports (per name: layer,
    head axis, indices one head group owns; `site_app.slice_layout`) and the arrays' shapes. The head dim is a
    layer's smallest head-group run (one KV head under grouped-query attention)."""
    head_dim: dict[int, int] = {}
    for layer, axis, unit in layout.values():
        if layer >= 0 and axis >= 0:
            head_dim[layer] = min(unit, head_dim.get(layer, unit))
    out = {}
    for name, (layer, axis, _) in layout.items():
        shape, period = tuple(shapes[name]), head_dim.get(layer, 0)
        if layer >= 0 and axis < 0 and (ffn := ffn_width_axis(name, layer)) is not None:
            axis, period = ffn, shape[ffn]
        out[name] = (
            WidthAxis(layer, axis, period, shape) if axis >= 0 else WidthAxis(layer, -1, 0, shape)
        )
    return out


def width_slices(layout: WidthLayout, spec: SubnetSpec) -> dict[str, Slice]:
    """The coordinates a width spec trains (at its widest, `spec.width_ratio`): in selected layers the window
    of every block along each tensor's width axis, the layer's other tensors whole; tensors outside the layers
    whole when `spec.train_outside`."""
    slices: dict[str, Slice] = {}
    for name, (layer, axis, period, shape) in layout.items():
        if layer < 0:
            if spec.train_outside:
                slices[name] = Slice(None)
            continue
        if layer not in spec.layers:
            continue
        if axis < 0:
            slices[name] = Slice(None)
            continue
        if period <= 0 or shape[axis] % period:
            raise SpecError(
                f"{name} has {shape[axis]} channels along axis {axis}, not whole blocks of {period}"
            )
        window = width_window(period, spec.width_ratio, spec.width_offset)
        slices[name] = Slice(
            axis, tuple(b * period + j for b in range(shape[axis] // period) for j in window)
        )
    return slices


def width_for_budget(layout: WidthLayout, budget: int, layers: Sequence[int]) -> tuple[float, int]:
    """The width ratio (over `layers`) whose trained coordinates come closest to `budget`, ties to the narrower,
    and that count. Candidates are the ratios k / period at which some window grows by one channel."""
    periods = {a.period for a in layout.values() if a.axis >= 0}
    best: tuple[int, float, int] | None = None
    for ratio in sorted({k / p for p in periods for k in range(1, p + 1)} | {1.0}):
        slices = width_slices(layout, SubnetSpec(layers=tuple(layers), width_ratio=ratio))
        count = sum(sl.numel(layout[name].shape) for name, sl in slices.items())
        if best is None or abs(count - budget) < best[0]:
            best = (abs(count - budget), ratio, count)
    assert best is not None
    return best[1], best[2]


__all__ = [
    "WidthAxis",
    "WidthLayout",
    "ffn_width_axis",
    "width_for_budget",
    "width_layout_from_heads",
    "width_slices",
    "width_window",
]
