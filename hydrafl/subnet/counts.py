"""What a model, or a subnetwork of it, counts: trainable parameters, their bytes, and forward FLOPs; the
numbers a site reports (MFU, payload sizes) and the tests check by hand.

FLOP formula (forward, one sequence of S tokens; `forward_flops`):

    F = 2 * S * W  +  sum over computed layers of  4 * S^2 * h * d

- W: weight elements of every nn.Linear / nn.Conv (LoRA base_layer, lora_A and lora_B included, the inactive
  `original_module` copy of a PEFT-saved head excluded) touched per token; one multiply-add = 2 FLOPs.
  Modules outside the transformer layers (LM head, classifier, pooler, ViT patch projection) are counted once
  per token: exact for an LM head, an upper bound for a head that only reads the pooled token.
- 4 * S^2 * h * d: attention scores (Q K^T, 2 S^2 d per head) and the weighted sum of values (2 S^2 d), for the
  h query heads of width d computed in the layer; dense S x S as the kernels execute it (causal included).
- Ignored (O(S * hidden)): embeddings lookups, biases, norms, activations, softmax, residual adds.
- Per subnetwork: bypassed layers cost 0. `executed=True` counts what `apply_spec` runs (frozen layers
  and masked heads or widths are still computed); `executed=False` counts the pruned subnetwork (the kept heads'
  share of the q/k/v rows and o columns, and of the attention term, in the selected layers; for a width spec
  the kept share of each head's dims and of the FFN hidden units, `width_window`, at the spec's widest).
"""

from __future__ import annotations

import torch
from torch import nn

from hydrafl.subnet.apply import trainable_slices
from hydrafl.subnet.architecture import Architecture, find_architecture, head_axis_of
from hydrafl.subnet.spec import SubnetSpec
from hydrafl.subnet.width import ffn_width_axis, width_window


def parameter_count(
    model: nn.Module, spec: SubnetSpec | None = None, *, trainable_only: bool = True
) -> int:
    """Elements of the (trainable) parameters; with `spec`, of the coordinates the subnetwork trains."""
    if spec is not None:
        if not trainable_only:
            raise ValueError(
                "a subnetwork count is a count of trained coordinates: use trainable_only=True"
            )
        params = dict(model.named_parameters())
        return sum(
            sl.numel(params[name].shape) for name, sl in trainable_slices(model, spec).items()
        )
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def parameter_bytes(
    model: nn.Module, spec: SubnetSpec | None = None, *, trainable_only: bool = True
) -> int:
    """Like `parameter_count`, in bytes of each tensor's dtype (what a full or sliced payload carries)."""
    if spec is not None:
        if not trainable_only:
            raise ValueError(
                "a subnetwork count is a count of trained coordinates: use trainable_only=True"
            )
        params = dict(model.named_parameters())
        return sum(
            sl.numel(params[name].shape) * params[name].element_size()
            for name, sl in trainable_slices(model, spec).items()
        )
    return sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if p.requires_grad or not trainable_only
    )


def _matmul_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d))
        and ".original_module" not in f".{name}"
    ]


def forward_flops(
    model: nn.Module, seq_len: int, spec: SubnetSpec | None = None, *, executed: bool = True
) -> int:
    """Forward FLOPs for one sequence of `seq_len` tokens (formula in the module docstring)."""
    arch: Architecture = find_architecture(model)
    if spec is not None:
        spec.check(arch)
    touched = 0.0
    for name, module in _matmul_modules(model):
        numel = module.weight.numel()
        layer, role, axis = head_axis_of(arch, name + ".weight")
        if layer is None:
            touched += numel
            continue
        if spec is not None and spec.bypass and layer not in spec.layers:
            continue
        fraction = 1.0
        if not executed and spec is not None and layer in spec.layers:
            if spec.is_width:
                fraction = _width_fraction(arch, spec, name, layer, axis, module.weight.shape)
            elif (
                role is not None
                and axis is not None
                and (kept := spec.heads_for(layer)) is not None
            ):
                fraction = len(kept) / arch.num_groups
        touched += numel * fraction
    attention = 0
    for ref in arch.layers:
        heads = arch.num_heads
        if spec is not None:
            if spec.bypass and ref.index not in spec.layers:
                continue
            if (
                not executed
                and ref.index in spec.layers
                and (kept := spec.heads_for(ref.index)) is not None
            ):
                heads = len(kept) * arch.group_size
        head_dim = arch.head_dim
        if spec is not None and spec.is_width and not executed and ref.index in spec.layers:
            head_dim = len(width_window(arch.head_dim, spec.width_ratio, spec.width_offset))
        attention += 4 * seq_len * seq_len * heads * head_dim
    return round(2 * seq_len * touched) + attention


def _width_fraction(
    arch: Architecture, spec: SubnetSpec, name: str, layer: int, axis: int | None, shape: torch.Size
) -> float:
    """The share of a layer's matmul weight a width spec keeps: its window of each head's dims (q/k/v rows,
    o columns) or of the FFN hidden units; 1 for anything not width-sliced (LoRA A of q, ...)."""
    period = arch.head_dim
    if axis is None:
        axis = ffn_width_axis(name + ".weight", layer)
        if axis is None:
            return 1.0
        period = shape[axis]
    return len(width_window(period, spec.width_ratio, spec.width_offset)) / period


__all__ = ["forward_flops", "parameter_bytes", "parameter_count"]
