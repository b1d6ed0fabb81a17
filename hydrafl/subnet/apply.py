"""Applying a `SubnetSpec` to a live model at a site: freeze or bypass the unselected layers, mask (or freeze)
the dropped heads, mask the dropped widths, all undone by `SubnetHandle.remove()`; and, from the live model,
exactly the coordinates a spec trains (`trainable_slices`) and how its tensors are width-sliced (`width_layout`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hydrafl.subnet.architecture import Architecture, find_architecture, has_module, head_axis_of
from hydrafl.subnet.families import FFN_PATTERNS, is_expert_tensor
from hydrafl.subnet.slices import Slice, expert_slice
from hydrafl.subnet.spec import SpecError, SubnetSpec
from hydrafl.subnet.width import WidthAxis, ffn_width_axis, width_slices, width_window

_FROZEN_MARK = "_hydrafl_frozen"


def is_federated(p: nn.Parameter) -> bool:
    """Trainable in the federation: requires grad now, or was frozen only by an applied spec."""
    return p.requires_grad or getattr(p, _FROZEN_MARK, False)


class _HeadMask:
    """Forward pre-hook on the attention output projection: input[..., g, :] *= keep[g] per KV group."""

    def __init__(self, keep: torch.Tensor) -> None:
        self.keep = keep  # [num_groups] of 0.0 / 1.0

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        keep = self.keep.to(dtype=x.dtype, device=x.device)
        masked = (x.unflatten(-1, (keep.numel(), -1)) * keep[:, None]).flatten(-2)
        return (masked, *args[1:])


class _GradientMask:
    """Gradient hook of a parameter: zero outside the coordinates its site trains."""

    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def __call__(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.mask.to(dtype=grad.dtype, device=grad.device)


def _freeze_dropped_heads(
    model: nn.Module, spec: SubnetSpec, arch: Architecture, handle: SubnetHandle
) -> None:
    params = dict(model.named_parameters())
    for name, sl in trainable_slices(model, spec, arch).items():
        if sl.dim is not None:  # a tensor some dropped head owns part of
            hook = _GradientMask(sl.mask(params[name].shape))
            handle._hooks.append(params[name].register_hook(hook))


def _freeze_other_experts(
    model: nn.Module, spec: SubnetSpec, arch: Architecture, handle: SubnetHandle
) -> None:
    """Gradient hooks zero the rows of the experts (and router rows) a selected layer does not train."""
    for name, p in model.named_parameters():
        layer = arch.layer_of(name)
        if layer in spec.layers and is_federated(p) and is_expert_tensor(name):
            kept = expert_slice(spec, layer)
            if kept.dim is not None:
                hook = _GradientMask(kept.mask(p.shape))
                handle._hooks.append(p.register_hook(hook))


def _identity_layer(*args: Any, **kwargs: Any) -> Any:
    return args[0] if args else kwargs["hidden_states"]


class SubnetHandle:
    """What `apply_spec` changed; `remove()` (or leaving the `with` block) restores the model exactly."""

    def __init__(self, model: nn.Module, spec: SubnetSpec, arch: Architecture) -> None:
        self.model, self.spec, self.arch = model, spec, arch
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._frozen: list[nn.Parameter] = []
        self._bypassed: list[nn.Module] = []
        self._width: _WidthMask | None = None

    @property
    def width_ratio(self) -> float:
        """The width the model computes at now (FjORD redraws it before every forward pass)."""
        return self._width.ratio if self._width is not None else 1.0

    def remove(self) -> None:
        """Undo every change `apply_spec` made: hooks, frozen flags, bypassed layers."""
        for hook in self._hooks:
            hook.remove()
        for p in self._frozen:
            p.requires_grad_(True)
            delattr(p, _FROZEN_MARK)
        for layer in self._bypassed:
            del layer.forward
        self._hooks, self._frozen, self._bypassed = [], [], []

    def __enter__(self) -> SubnetHandle:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def apply_spec(
    model: nn.Module, spec: SubnetSpec, arch: Architecture | None = None
) -> SubnetHandle:
    """Make `model` train only the subnetwork `spec`, in place, until `handle.remove()`.

    - Unselected layers: their trainable parameters get requires_grad=False (marked, so `trainable_slices`
      still knows they are federated coordinates), or with `spec.bypass` the layer's forward becomes the
      identity on hidden states (no compute; restored by remove()).
    - Dropped heads of selected layers: a forward pre-hook on the attention output projection multiplies the
      concatenated head outputs by a 0/1 mask per KV group, so their q/k/v rows, o columns, LoRA B rows of
      q/k/v and LoRA A columns of o get exactly zero gradient. (An optimizer with weight decay still moves
      those coordinates; `extract` never sends them.) With `spec.freeze_heads` they stay in the forward pass
      and a gradient hook on each of those tensors zeroes the same coordinates instead.
    - Experts of a mixture-of-experts layer outside `spec.experts`: they stay in the forward pass (the router
      sends every token where the global model does), and a gradient hook on the experts' stacked weights
      and the router weight zeroes their rows, so exactly those coordinates get zero gradient.
    - `spec.train_outside=False` freezes the trainable tensors outside the layers as well.
    - A width spec (`spec.is_width`): in selected layers, forward hooks zero the dropped dims of every head at
      the q and k outputs and at the o input, and the dropped FFN hidden units at the FFN output projection's
      input, so exactly the coordinates outside `width_slices` get zero gradient. With `spec.width_levels` the
      width is redrawn before every forward pass from a generator seeded with `spec.width_seed` (FjORD).
    """
    arch = arch or find_architecture(model)
    spec.check(arch)
    handle = SubnetHandle(model, spec, arch)
    try:
        for name, p in model.named_parameters():
            layer = arch.layer_of(name)
            freeze = (layer is None and not spec.train_outside) or (
                layer is not None and layer not in spec.layers
            )
            if freeze and p.requires_grad:
                p.requires_grad_(False)
                setattr(p, _FROZEN_MARK, True)
                handle._frozen.append(p)
        for ref in arch.layers:
            if ref.index not in spec.layers:
                if spec.bypass:
                    layer_module = model.get_submodule(ref.name)
                    layer_module.forward = _identity_layer
                    handle._bypassed.append(layer_module)
                continue
            kept = spec.heads_for(ref.index)
            if kept is None or spec.freeze_heads:
                continue
            keep = torch.zeros(arch.num_groups)
            keep[list(kept)] = 1.0
            handle._hooks.append(
                model.get_submodule(ref.o).register_forward_pre_hook(_HeadMask(keep))
            )
        if spec.freeze_heads and spec.heads is not None:
            _freeze_dropped_heads(model, spec, arch, handle)
        if spec.experts is not None:
            _freeze_other_experts(model, spec, arch, handle)
        if spec.is_width:
            _add_width_hooks(model, spec, arch, handle)
    except BaseException:
        handle.remove()
        raise
    return handle


class _WidthMask:
    """The 0/1 channel masks of a width spec, shared by its hooks; FjORD redraws the width before each forward."""

    def __init__(self, spec: SubnetSpec, generator: torch.Generator) -> None:
        self.spec, self.generator = spec, generator
        self.choices = tuple(v for v in spec.width_levels if v < spec.width_ratio) + (
            spec.width_ratio,
        )
        self.ratio = spec.width_ratio
        self._masks: dict[tuple[float, int, int], torch.Tensor] = {}

    def draw(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if len(self.choices) > 1:
            self.ratio = self.choices[
                int(torch.randint(len(self.choices), (), generator=self.generator))
            ]

    def mask(self, period: int, length: int, like: torch.Tensor) -> torch.Tensor:
        key = (self.ratio, period, length)
        if key not in self._masks:
            block = torch.zeros(period)
            block[list(width_window(period, self.ratio, self.spec.width_offset))] = 1.0
            self._masks[key] = block.repeat(length // period)
        return self._masks[key].to(dtype=like.dtype, device=like.device)

    def output_hook(self, period: int) -> Callable[..., torch.Tensor]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            return output * self.mask(period, output.shape[-1], output)

        return hook

    def input_hook(self, period: int | None) -> Callable[..., tuple[Any, ...]]:
        def hook(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
            x = args[0]
            return (x * self.mask(period or x.shape[-1], x.shape[-1], x), *args[1:])

        return hook


def _add_width_hooks(
    model: nn.Module, spec: SubnetSpec, arch: Architecture, handle: SubnetHandle
) -> None:
    """Mask q/k outputs and o inputs per head dim, and the FFN output projection's input per hidden unit."""
    width = handle._width = _WidthMask(spec, torch.Generator().manual_seed(spec.width_seed))
    handle._hooks.append(model.register_forward_pre_hook(width.draw))
    ffn_out = FFN_PATTERNS[arch.family][1]
    for ref in arch.layers:
        if ref.index not in spec.layers:
            continue
        if not has_module(model, f"{ref.name}.{ffn_out}"):
            raise SpecError(
                f"layer {ref.index} has no FFN output projection {ffn_out!r}; cannot apply a width"
            )
        for path in (ref.q, ref.k):
            handle._hooks.append(
                model.get_submodule(path).register_forward_hook(width.output_hook(arch.head_dim))
            )
        handle._hooks.append(
            model.get_submodule(ref.o).register_forward_pre_hook(width.input_hook(arch.head_dim))
        )
        out = model.get_submodule(f"{ref.name}.{ffn_out}")
        handle._hooks.append(out.register_forward_pre_hook(width.input_hook(None)))


def trainable_slices(
    model: nn.Module, spec: SubnetSpec, arch: Architecture | None = None
) -> dict[str, Slice]:
    """Exactly the coordinates the subnetwork trains, per parameter name (names of `model.named_parameters()`).

    Considered tensors are the federated trainable ones (requires_grad, or frozen by `apply_spec`); under LoRA
    that is the LoRA factors plus any saved head, never the frozen base weights. Per selected layer:
    rows of q/k/v weight, bias, LoRA B (and DoRA magnitude) for the kept heads (k/v: the kept KV heads),
    columns of o weight and o LoRA A for the kept query heads, everything else of the layer whole (q/k/v LoRA A,
    o bias, o LoRA B, FFN, norms), except the rows of the trained experts of the expert tensors (router
    weight, stacked expert weights; `expert_slice`). Unselected layers contribute nothing; tensors outside the
    layers are whole when `spec.train_outside`."""
    arch = arch or find_architecture(model)
    spec.check(arch)
    if spec.is_width:
        return width_slices(width_layout(model, arch), spec)
    slices: dict[str, Slice] = {}
    for name, p in model.named_parameters():
        if not is_federated(p):
            continue
        layer, role, axis = head_axis_of(arch, name)
        if layer is None:
            if spec.train_outside:
                slices[name] = Slice(None)
            continue
        if layer not in spec.layers:
            continue
        if is_expert_tensor(name):
            slices[name] = expert_slice(spec, layer)
            continue
        kept = spec.heads_for(layer)
        if axis is None or kept is None:
            slices[name] = Slice(None)
            continue
        dims = arch.kv_dims(kept) if role in ("k", "v") else arch.query_dims(kept)
        if (
            p.shape[axis]
            != (arch.num_kv_heads if role in ("k", "v") else arch.num_heads) * arch.head_dim
        ):
            raise ValueError(
                f"{name} has shape {tuple(p.shape)}; axis {axis} does not match the head layout"
            )
        slices[name] = Slice(axis, tuple(dims))
    return slices


def width_layout(model: nn.Module, arch: Architecture | None = None) -> dict[str, WidthAxis]:
    """Site side: how each federated tensor of a live model is width-sliced."""
    arch = arch or find_architecture(model)
    layout = {}
    for name, p in model.named_parameters():
        if not is_federated(p):
            continue
        layer, _, axis = head_axis_of(arch, name)
        period = arch.head_dim
        if layer is not None and axis is None and (axis := ffn_width_axis(name, layer)) is not None:
            period = p.shape[axis]
        layer = -1 if layer is None else layer
        layout[name] = (
            WidthAxis(layer, -1, 0, tuple(p.shape))
            if axis is None
            else WidthAxis(layer, axis, period, tuple(p.shape))
        )
    return layout


__all__ = ["SubnetHandle", "apply_spec", "is_federated", "trainable_slices", "width_layout"]
