"""Hydra-net mechanics: the part of a global transformer one site trains, and how to find it.

A Hydra-net is (1) a set of layers taken from a global ranking and (2) within each of them the attention heads
(KV groups under grouped-query attention) that matter most for the site's data. This module does, on live
Hugging Face models (BERT, ViT, Llama-style; plain or wrapped by PEFT LoRA):

- `SubnetSpec`: the selection, serialisable into a flat Flower ConfigRecord.
- `find_architecture`: where the layers and the q/k/v/o projections are, heads, KV heads, head size.
- `apply_spec`: freeze (or bypass) unselected layers and mask dropped heads with a forward pre-hook on the
  attention output projection (transformers 5 ignores `head_mask`). Masked heads get exactly zero gradient.
- `trainable_slices` / `extract` / `merge` / `payload_bytes`: exactly the rows/columns a site trains, so
  only those bytes travel up, and the way back into the full tensors; `read_slices`: what the subnetwork's
  forward pass reads, the only bytes that travel down.
- `layer_importance` / `head_importance`: scores a site computes on its own data (a few floats).
- `combine_layer_scores`, `select_heads`, `build_spec`, `plan_budget`: what the coordinator does with them.

Head layout. Every supported attention concatenates head outputs head-major before the output projection:
the input of o is [..., num_heads * head_dim] and head h owns dims [h*d, (h+1)*d). Under grouped-query
attention query head h reads KV head h // (num_heads // num_kv_heads) (transformers' `repeat_kv`), so the unit
of selection is the KV group: keeping group g keeps KV head g and query heads g*r .. g*r + r - 1.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from hydrafl.footprint import training_footprint
from hydrafl.losses import LossFn, classification_loss

# --------------------------------------------------------------------------------------------------------------
# Subnetwork specification
# --------------------------------------------------------------------------------------------------------------


class SpecError(ValueError):
    """A SubnetSpec that is malformed or does not fit the model; the message says what and where."""


def _int_tuple(values: Iterable[Any], what: str) -> tuple[int, ...]:
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(f"{what} must be integers, got {v!r}")
        if v < 0:
            raise SpecError(f"{what} must be >= 0, got {v}")
        out.append(int(v))
    if len(set(out)) != len(out):
        raise SpecError(f"{what} contain duplicates: {out}")
    return tuple(out)


@dataclass(frozen=True)
class SubnetSpec:
    """The subnetwork one site trains.

    layers: selected layer indices (0-based; stored sorted).
    heads: per selected layer (aligned with `layers`), the kept head indices, i.e. KV-group indices under
        grouped-query attention (query heads follow their group); None keeps every head of every selected
        layer. Stored sorted.
    width_ratio: for the width-based baselines (HeteroFL, FjORD, FedRolex): in every selected layer, the share
        of each head's dims and of the FFN hidden units the site keeps (see `width_window`); 1 keeps all.
        A spec selects heads or a width, not both.
    width_offset: first kept channel of each width block (FedRolex's rolling window, wrapping around);
        0 keeps the leading channels (HeteroFL, FjORD).
    width_levels: FjORD's ordered dropout: before each forward pass the site draws a width uniformly from the
        levels below `width_ratio` and `width_ratio` itself; empty trains at `width_ratio` throughout.
    width_seed: seeds those draws. Part of the spec so that every process of a multi-process site draws the same
        widths; the strategy varies it per round and site.
    bypass: unselected layers are skipped (identity on hidden states, saves their compute) instead of frozen.
        This changes the function the site trains, so it is part of the spec, not a site-local choice.
    freeze_heads: dropped heads stay in the forward pass, frozen (their coordinates get zero gradient), instead
        of being masked out: the site trains the global model's own function, which matters for a pretrained
        model, and reads the dropped heads' coordinates too. Both cost the same compute.
    train_outside: the trainable tensors outside the transformer layers (classifier / LoRA-saved head,
        embeddings when trainable) are trained too; False freezes them.
    """

    layers: tuple[int, ...]
    heads: tuple[tuple[int, ...], ...] | None = None
    width_ratio: float = 1.0
    width_offset: int = 0
    width_levels: tuple[float, ...] = ()
    width_seed: int = 0
    bypass: bool = False
    train_outside: bool = True
    freeze_heads: bool = False

    def __post_init__(self) -> None:
        layers = _int_tuple(self.layers, "layer indices")
        if not layers:
            raise SpecError("empty selection: a SubnetSpec needs at least one layer")
        heads = self.heads
        if heads is not None:
            heads = tuple(heads)
            if len(heads) != len(layers):
                raise SpecError(
                    f"heads must give one tuple per selected layer: {len(layers)} layers, {len(heads)} head tuples"
                )
            heads = tuple(_int_tuple(h, f"head indices of layer {layer}") for layer, h in zip(layers, heads))
            for layer, h in zip(layers, heads):
                if not h:
                    raise SpecError(f"empty selection: layer {layer} keeps no heads (drop the layer instead)")
            order = sorted(range(len(layers)), key=lambda i: layers[i])
            heads = tuple(tuple(sorted(heads[i])) for i in order)
        ratio = self.width_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < float(ratio) <= 1.0:
            raise SpecError(f"width_ratio must be a number in (0, 1], got {ratio!r}")
        for key in ("width_offset", "width_seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise SpecError(f"{key} must be an integer >= 0, got {value!r}")
        levels = tuple(self.width_levels)
        if not all(not isinstance(v, bool) and isinstance(v, (int, float)) and 0.0 < v <= 1.0 for v in levels):
            raise SpecError(f"width_levels must be numbers in (0, 1], got {list(levels)}")
        if heads is not None and (float(ratio) < 1.0 or levels):
            raise SpecError("a SubnetSpec selects heads or a width (width_ratio < 1 / width_levels), not both")
        object.__setattr__(self, "layers", tuple(sorted(layers)))
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "width_ratio", float(ratio))
        object.__setattr__(self, "width_levels", tuple(sorted({float(v) for v in levels})))
        object.__setattr__(self, "bypass", bool(self.bypass))
        object.__setattr__(self, "freeze_heads", bool(self.freeze_heads))
        object.__setattr__(self, "train_outside", bool(self.train_outside))

    @classmethod
    def full(cls, num_layers: int, **kwargs: Any) -> SubnetSpec:
        """Every layer, every head (the full model as a spec)."""
        return cls(layers=tuple(range(num_layers)), **kwargs)

    @property
    def is_width(self) -> bool:
        """A width-baseline spec (slices channels) rather than a Hydra layer/head selection."""
        return self.width_ratio < 1.0 or bool(self.width_levels)

    def heads_for(self, layer: int) -> tuple[int, ...] | None:
        """Kept heads (KV groups) of a selected layer; None means all. KeyError if the layer is not selected."""
        if layer not in self.layers:
            raise KeyError(f"layer {layer} is not selected (selected: {list(self.layers)})")
        return None if self.heads is None else self.heads[self.layers.index(layer)]

    def check(self, arch: Architecture) -> None:
        """Raise SpecError if the spec does not fit the model."""
        for layer in self.layers:
            if layer >= arch.num_layers:
                raise SpecError(
                    f"layer {layer} out of range: the model has {arch.num_layers} layers (0..{arch.num_layers - 1})"
                )
        if self.heads is not None:
            unit = "KV group" if arch.group_size > 1 else "head"
            for layer, kept in zip(self.layers, self.heads):
                for h in kept:
                    if h >= arch.num_groups:
                        raise SpecError(
                            f"{unit} {h} of layer {layer} out of range: the model has {arch.num_groups} "
                            f"{unit}s per layer (0..{arch.num_groups - 1})"
                        )

    # ---- ConfigRecord (flat: str/int/float/bool and lists of one scalar type, no nested dicts) ----

    def to_config(self, prefix: str = "hydra.") -> dict[str, int | float | bool | str | list[int]]:
        """Flat dict for a Flower ConfigRecord. Ragged per-layer heads are stored as counts + concatenation."""
        config: dict[str, Any] = {
            f"{prefix}layers": list(self.layers),
            f"{prefix}all-heads": self.heads is None,
            f"{prefix}width-ratio": self.width_ratio,
            f"{prefix}bypass": self.bypass,
            f"{prefix}train-outside": self.train_outside,
            f"{prefix}freeze-heads": self.freeze_heads,
        }
        if self.heads is not None:
            config[f"{prefix}head-counts"] = [len(h) for h in self.heads]
            config[f"{prefix}heads"] = [h for kept in self.heads for h in kept]
        if self.width_offset:
            config[f"{prefix}width-offset"] = self.width_offset
        if self.width_levels:
            config[f"{prefix}width-levels"] = list(self.width_levels)
            config[f"{prefix}width-seed"] = self.width_seed
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any], prefix: str = "hydra.") -> SubnetSpec:
        """Inverse of `to_config`; raises SpecError naming the missing or malformed key."""

        def get(key: str, types: tuple[type, ...], default: Any = None) -> Any:
            name = prefix + key
            if name not in config and default is not None:
                return default
            if name not in config:
                raise SpecError(f"config has no {name!r} (keys: {sorted(config)})")
            value = config[name]
            if types == (list,):
                if not isinstance(value, (list, tuple)):
                    raise SpecError(f"{name!r} must be a list of integers, got {value!r}")
                return list(value)
            if isinstance(value, bool) and bool not in types:
                raise SpecError(f"{name!r} must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
            if not isinstance(value, types):
                raise SpecError(f"{name!r} must be {'/'.join(t.__name__ for t in types)}, got {value!r}")
            return value

        layers = get("layers", (list,))
        heads = None
        if not get("all-heads", (bool,)):
            counts = get("head-counts", (list,))
            flat = get("heads", (list,))
            if len(counts) != len(layers) or sum(counts) != len(flat) or any(
                isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts
            ):
                raise SpecError(
                    f"{prefix}head-counts {counts} does not split {prefix}heads (length {len(flat)}) "
                    f"over {len(layers)} layers"
                )
            starts = [sum(counts[:i]) for i in range(len(counts))]
            heads = tuple(tuple(flat[s : s + c]) for s, c in zip(starts, counts))
        return cls(
            layers=tuple(layers),
            heads=heads,
            width_ratio=get("width-ratio", (int, float)),
            width_offset=get("width-offset", (int,), 0),
            width_levels=tuple(get("width-levels", (list,), [])),
            width_seed=get("width-seed", (int,), 0),
            bypass=get("bypass", (bool,)),
            train_outside=get("train-outside", (bool,)),
            freeze_heads=get("freeze-heads", (bool,), False),
        )


# --------------------------------------------------------------------------------------------------------------
# Architecture adapter
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Pattern:
    family: str
    attention: str  # module (relative to a layer) whose forward returns (output, attention weights)
    q: str
    k: str
    v: str
    o: str


# Module paths relative to one entry of the model's layer list (transformers 5.x). PEFT LoRA keeps these module
# paths (the Linear becomes a LoRA wrapper holding `base_layer`, `lora_A.<adapter>`, `lora_B.<adapter>`), and
# only prefixes the layer list's path with `base_model.model.`.
PATTERNS: tuple[_Pattern, ...] = (
    _Pattern(
        "bert", "attention.self", "attention.self.query", "attention.self.key", "attention.self.value",
        "attention.output.dense",
    ),
    _Pattern("vit", "attention", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj"),
    _Pattern("llama", "self_attn", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
)


@dataclass(frozen=True)
class LayerRef:
    """One transformer layer: full module names (as in `model.named_modules()`) of it and its projections."""

    index: int
    name: str
    attention: str
    q: str
    k: str
    v: str
    o: str


@dataclass(frozen=True)
class Architecture:
    family: str  # "bert", "vit" or "llama" (any `self_attn.{q,k,v,o}_proj` decoder)
    layers_name: str  # the nn.ModuleList holding the layers
    layers: tuple[LayerRef, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 without grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    @property
    def num_groups(self) -> int:
        """Units of head selection per layer: KV groups (= heads without grouped-query attention)."""
        return self.num_kv_heads

    def query_heads(self, group: int) -> range:
        return range(group * self.group_size, (group + 1) * self.group_size)

    def query_dims(self, groups: Iterable[int]) -> list[int]:
        """Dims of the q output / o input owned by the query heads of `groups`."""
        d = self.head_dim
        return [i for g in sorted(groups) for h in self.query_heads(g) for i in range(h * d, (h + 1) * d)]

    def kv_dims(self, groups: Iterable[int]) -> list[int]:
        d = self.head_dim
        return [i for g in sorted(groups) for i in range(g * d, (g + 1) * d)]

    def layer_of(self, name: str) -> int | None:
        """Layer index of a parameter or module name, or None if it lies outside the layers."""
        if not name.startswith(self.layers_name + "."):
            return None
        rest = name[len(self.layers_name) + 1 :]
        head = rest.split(".", 1)[0]
        return int(head) if head.isdigit() and int(head) < len(self.layers) else None


def _has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def _base_linear(module: nn.Module) -> nn.Module:
    """The plain Linear under any PEFT wrappers."""
    while hasattr(module, "base_layer"):
        module = module.base_layer
    if not isinstance(module, nn.Linear):
        raise TypeError(f"expected an nn.Linear projection, found {type(module).__name__}")
    return module


def find_architecture(model: nn.Module) -> Architecture:
    """Locate the layer list and the attention projections of a BERT, ViT or Llama-style model (also inside
    `hydrafl.models.Classifier` and PEFT wrappers). Raises ValueError for anything else."""
    found: list[tuple[str, nn.ModuleList, _Pattern]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        for pattern in PATTERNS:
            if all(all(_has(child, p) for p in (pattern.q, pattern.k, pattern.v, pattern.o)) for child in module):
                found.append((name, module, pattern))
    if not found:
        raise ValueError(
            f"no supported transformer layer list in {type(model).__name__}; supported layer contents: "
            + "; ".join(f"{p.family}: {p.q}, {p.k}, {p.v}, {p.o}" for p in PATTERNS)
        )
    if len(found) > 1:
        raise ValueError(f"several transformer layer lists found ({[f[0] for f in found]}); only one is supported")
    list_name, layer_list, pattern = found[0]
    layers, shapes = [], set()
    for i, layer in enumerate(layer_list):
        base = f"{list_name}.{i}"
        attention = layer.get_submodule(pattern.attention)
        head_dim = getattr(attention, "head_dim", None) or getattr(attention, "attention_head_size", None)
        q = _base_linear(layer.get_submodule(pattern.q))
        k = _base_linear(layer.get_submodule(pattern.k))
        o = _base_linear(layer.get_submodule(pattern.o))
        if not head_dim or q.out_features % head_dim or k.out_features % head_dim:
            raise ValueError(f"cannot infer the head size of layer {i} ({type(attention).__name__})")
        shapes.add((q.out_features // head_dim, k.out_features // head_dim, int(head_dim), o.out_features))
        layers.append(
            LayerRef(
                index=i,
                name=base,
                attention=f"{base}.{pattern.attention}",
                q=f"{base}.{pattern.q}",
                k=f"{base}.{pattern.k}",
                v=f"{base}.{pattern.v}",
                o=f"{base}.{pattern.o}",
            )
        )
    if len(shapes) != 1:
        raise ValueError(f"layers differ in (heads, kv heads, head size, hidden): {sorted(shapes)}")
    heads, kv_heads, head_dim, hidden = shapes.pop()
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    return Architecture(pattern.family, list_name, tuple(layers), heads, kv_heads, head_dim, hidden)


# Role of a parameter inside an attention projection, from its name suffix after the projection's module name.
#   weight / bias / base_layer.weight / base_layer.bias -> "base";  lora_A.<adapter>.weight -> "A";
#   lora_B.<adapter>.weight -> "B";  lora_magnitude_vector.<adapter>.weight (DoRA) -> "magnitude"; else None.
def _part(suffix: str) -> str | None:
    if suffix in ("weight", "bias", "base_layer.weight", "base_layer.bias"):
        return "base"
    head = suffix.split(".", 1)[0]
    return {"lora_A": "A", "lora_B": "B", "lora_magnitude_vector": "magnitude"}.get(head)


def _head_axis(role: str, part: str | None, suffix: str) -> int | None:
    """Axis of a q/k/v/o tensor that is indexed by head dims, or None if every element serves every head.

    q/k/v: output rows are per head: base weight and bias rows, LoRA B rows, DoRA magnitude. LoRA A (r x in)
    feeds every output row: shared. o: input columns are per head: base weight columns and LoRA A columns
    (A is r x (heads*head_dim), its column j multiplies head-dim j of the input); o bias, LoRA B (out x r)
    and the DoRA magnitude (per output row) are shared."""
    if part is None:
        return None
    if role in ("q", "k", "v"):
        return 0 if part in ("base", "B", "magnitude") else None
    if part == "base":
        return 1 if suffix.endswith("weight") else None
    return 1 if part == "A" else None


def head_axis_of(arch: Architecture, name: str) -> tuple[int | None, str | None, int | None]:
    """(layer, role in "q"/"k"/"v"/"o" or None, head axis or None) of a parameter name: the axis along which the
    tensor is indexed by head dims (see `_head_axis`), None when every element serves every head."""
    layer, role, suffix = _classify(arch, name)
    axis = None if role is None else _head_axis(role, _part(suffix), suffix)
    return layer, role, axis


def _classify(arch: Architecture, name: str) -> tuple[int | None, str | None, str]:
    """(layer, role in q/k/v/o or None, suffix) of a parameter name."""
    layer = arch.layer_of(name)
    if layer is None:
        return None, None, ""
    ref = arch.layers[layer]
    for role in ("q", "k", "v", "o"):
        module = getattr(ref, role)
        if name.startswith(module + "."):
            return layer, role, name[len(module) + 1 :]
    return layer, None, ""


# --------------------------------------------------------------------------------------------------------------
# Applying a spec to a live model
# --------------------------------------------------------------------------------------------------------------

_FROZEN_MARK = "_hydrafl_frozen"


def _federated(p: nn.Parameter) -> bool:
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


def _freeze_dropped_heads(model: nn.Module, spec: SubnetSpec, arch: Architecture, handle: SubnetHandle) -> None:
    params = dict(model.named_parameters())
    for name, sl in trainable_slices(model, spec, arch).items():
        if sl.dim is not None:  # a tensor some dropped head owns part of
            hook = _GradientMask(sl.mask(params[name].shape))
            handle._hooks.append(params[name].register_hook(hook))


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


def apply_spec(model: nn.Module, spec: SubnetSpec, arch: Architecture | None = None) -> SubnetHandle:
    """Make `model` train only the subnetwork `spec`, in place, until `handle.remove()`.

    - Unselected layers: their trainable parameters get requires_grad=False (marked, so `trainable_slices`
      still knows they are federated coordinates), or with `spec.bypass` the layer's forward becomes the
      identity on hidden states (no compute; restored by remove()).
    - Dropped heads of selected layers: a forward pre-hook on the attention output projection multiplies the
      concatenated head outputs by a 0/1 mask per KV group, so their q/k/v rows, o columns, LoRA B rows of
      q/k/v and LoRA A columns of o get exactly zero gradient. (An optimizer with weight decay still moves
      those coordinates; `extract` never sends them.) With `spec.freeze_heads` they stay in the forward pass
      and a gradient hook on each of those tensors zeroes the same coordinates instead.
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
            freeze = (layer is None and not spec.train_outside) or (layer is not None and layer not in spec.layers)
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
            handle._hooks.append(model.get_submodule(ref.o).register_forward_pre_hook(_HeadMask(keep)))
        if spec.freeze_heads and spec.heads is not None:
            _freeze_dropped_heads(model, spec, arch, handle)
        if spec.is_width:
            _add_width_hooks(model, spec, arch, handle)
    except BaseException:
        handle.remove()
        raise
    return handle


# --------------------------------------------------------------------------------------------------------------
# Trained slices: extract / merge / bytes
# --------------------------------------------------------------------------------------------------------------


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
            target.index_add_(self.dim, self._index.to(target.device), values.to(target.dtype), alpha=alpha)

    def mask(self, shape: Sequence[int]) -> torch.Tensor:
        """Boolean tensor of `shape`, True on the sliced coordinates (m_kj of the masked aggregation)."""
        if self.dim is None:
            return torch.ones(tuple(shape), dtype=torch.bool)
        return torch.zeros(tuple(shape), dtype=torch.bool).index_fill_(self.dim, self._index, True)


def trainable_slices(model: nn.Module, spec: SubnetSpec, arch: Architecture | None = None) -> dict[str, Slice]:
    """Exactly the coordinates the subnetwork trains, per parameter name (names of `model.named_parameters()`).

    Considered tensors are the federated trainable ones (requires_grad, or frozen by `apply_spec`); under LoRA
    that is the LoRA factors plus any saved head, never the frozen base weights. Per selected layer:
    rows of q/k/v weight, bias, LoRA B (and DoRA magnitude) for the kept heads (k/v: the kept KV heads),
    columns of o weight and o LoRA A for the kept query heads, everything else of the layer whole (q/k/v LoRA A,
    o bias, o LoRA B, FFN, norms). Unselected layers contribute nothing; tensors outside the layers are whole
    when `spec.train_outside`."""
    arch = arch or find_architecture(model)
    spec.check(arch)
    if spec.is_width:
        return width_slices(width_layout(model, arch), spec)
    slices: dict[str, Slice] = {}
    for name, p in model.named_parameters():
        if not _federated(p):
            continue
        layer, role, axis = head_axis_of(arch, name)
        if layer is None:
            if spec.train_outside:
                slices[name] = Slice(None)
            continue
        if layer not in spec.layers:
            continue
        kept = spec.heads_for(layer)
        if axis is None or kept is None:
            slices[name] = Slice(None)
            continue
        dims = arch.kv_dims(kept) if role in ("k", "v") else arch.query_dims(kept)
        if p.shape[axis] != (arch.num_kv_heads if role in ("k", "v") else arch.num_heads) * arch.head_dim:
            raise ValueError(f"{name} has shape {tuple(p.shape)}; axis {axis} does not match the head layout")
        slices[name] = Slice(axis, tuple(dims))
    return slices


def read_slices(trained: Mapping[str, Slice], layers: Mapping[str, int], spec: SubnetSpec) -> dict[str, Slice]:
    """The coordinates a subnetwork's forward pass reads, which is all a site has to download: what it trains
    (`trained`, from `trainable_slices` or the coordinator's layout), and every other federated tensor whole
    (`layers`: per name its layer, -1 outside the layers) except those of the layers `spec.bypass` skips.
    Dropped heads and widths are outside it: `apply_spec` zeroes their outputs before anything uses them
    (unless `spec.freeze_heads` keeps them running: then every read tensor is whole).
    The coordinator and the site both compute it, so it depends on nothing but these arguments."""
    return {
        name: Slice(None) if spec.freeze_heads else trained.get(name, Slice(None))
        for name, layer in layers.items()
        if name in trained or not (spec.bypass and layer >= 0 and layer not in spec.layers)
    }


def extract(state: Mapping[str, torch.Tensor], slices: Mapping[str, Slice]) -> dict[str, torch.Tensor]:
    """The sliced coordinates of `state`, one compact tensor per name (same dtype)."""
    missing = [name for name in slices if name not in state]
    if missing:
        raise KeyError(f"state lacks {len(missing)} sliced tensors, e.g. {missing[:3]}")
    return {name: sl.take(state[name]) for name, sl in slices.items()}


def merge(
    base: Mapping[str, torch.Tensor], slices: Mapping[str, Slice], extracted: Mapping[str, torch.Tensor]
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


def coordinate_masks(slices: Mapping[str, Slice], state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full-shape boolean masks of the sliced coordinates (for masked per-coordinate aggregation)."""
    return {name: sl.mask(state[name].shape) for name, sl in slices.items()}


# --------------------------------------------------------------------------------------------------------------
# Width slicing (HeteroFL / FjORD / FedRolex)
# --------------------------------------------------------------------------------------------------------------
#
# A width ratio r keeps, in every selected layer, ceil(r * d) of the d dims of EVERY attention head (rows of q/k/v
# and of their LoRA B, the matching columns of o and of its LoRA A) and ceil(r * I) of the I FFN hidden units
# (rows of the FFN input projections, columns of the output projection). The residual stream (embeddings, norms,
# the o and FFN output biases, the classifier) stays whole and every site trains it: zeroing residual channels
# would still let LayerNorm write into them, so masking cannot give HeteroFL's narrower residual stream.
# Along a width axis a tensor is a run of blocks of `period` channels (one per head, or the whole FFN); every
# block keeps the same window.

FFN_PATTERNS: Mapping[str, tuple[tuple[str, ...], str]] = {
    "bert": (("intermediate.dense",), "output.dense"),
    "vit": (("mlp.fc1",), "mlp.fc2"),
    "llama": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
}
"""Per family, FFN module paths relative to a layer: the projections into the hidden units, the one out of them."""


class WidthAxis(NamedTuple):
    """How one federated tensor is width-sliced."""

    layer: int  # -1 outside the layers
    axis: int  # -1 when the tensor is not width-sliced
    period: int  # channels per block along `axis`: the head dim, or the FFN hidden units
    shape: tuple[int, ...]


WidthLayout = Mapping[str, WidthAxis]


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
                return _head_axis(role, _part(suffix), suffix)
    return None


def width_layout(model: nn.Module, arch: Architecture | None = None) -> dict[str, WidthAxis]:
    """Site side: how each federated tensor of a live model is width-sliced."""
    arch = arch or find_architecture(model)
    layout = {}
    for name, p in model.named_parameters():
        if not _federated(p):
            continue
        layer, _, axis = head_axis_of(arch, name)
        period = arch.head_dim
        if layer is not None and axis is None and (axis := ffn_width_axis(name, layer)) is not None:
            period = p.shape[axis]
        layer = -1 if layer is None else layer
        layout[name] = WidthAxis(layer, -1, 0, tuple(p.shape)) if axis is None else WidthAxis(layer, axis, period, tuple(p.shape))
    return layout


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
        out[name] = WidthAxis(layer, axis, period, shape) if axis >= 0 else WidthAxis(layer, -1, 0, shape)
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
            raise SpecError(f"{name} has {shape[axis]} channels along axis {axis}, not whole blocks of {period}")
        window = width_window(period, spec.width_ratio, spec.width_offset)
        slices[name] = Slice(axis, tuple(b * period + j for b in range(shape[axis] // period) for j in window))
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


class _WidthMask:
    """The 0/1 channel masks of a width spec, shared by its hooks; FjORD redraws the width before each forward."""

    def __init__(self, spec: SubnetSpec, generator: torch.Generator) -> None:
        self.spec, self.generator = spec, generator
        self.choices = tuple(v for v in spec.width_levels if v < spec.width_ratio) + (spec.width_ratio,)
        self.ratio = spec.width_ratio
        self._masks: dict[tuple[float, int, int], torch.Tensor] = {}

    def draw(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if len(self.choices) > 1:
            self.ratio = self.choices[int(torch.randint(len(self.choices), (), generator=self.generator))]

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


def _add_width_hooks(model: nn.Module, spec: SubnetSpec, arch: Architecture, handle: SubnetHandle) -> None:
    """Mask q/k outputs and o inputs per head dim, and the FFN output projection's input per hidden unit."""
    width = handle._width = _WidthMask(spec, torch.Generator().manual_seed(spec.width_seed))
    handle._hooks.append(model.register_forward_pre_hook(width.draw))
    ffn_out = FFN_PATTERNS[arch.family][1]
    for ref in arch.layers:
        if ref.index not in spec.layers:
            continue
        if not _has(model, f"{ref.name}.{ffn_out}"):
            raise SpecError(f"layer {ref.index} has no FFN output projection {ffn_out!r}; cannot apply a width")
        for path in (ref.q, ref.k):
            handle._hooks.append(model.get_submodule(path).register_forward_hook(width.output_hook(arch.head_dim)))
        handle._hooks.append(model.get_submodule(ref.o).register_forward_pre_hook(width.input_hook(arch.head_dim)))
        out = model.get_submodule(f"{ref.name}.{ffn_out}")
        handle._hooks.append(out.register_forward_pre_hook(width.input_hook(None)))


# --------------------------------------------------------------------------------------------------------------
# Importance scores (computed at a site on its own data)
# --------------------------------------------------------------------------------------------------------------



def _samples(
    batches: Iterable[tuple[Any, torch.Tensor]], max_samples: int | None
) -> Iterator[tuple[Any, torch.Tensor]]:
    """Batches cut so that at most `max_samples` samples are seen; x is a tensor or a dict of tensors."""
    seen = 0
    for x, y in batches:
        n = len(y)
        if max_samples is not None:
            n = min(n, max_samples - seen)
            if n <= 0:
                return
        take = (lambda t: t[:n]) if n < len(y) else (lambda t: t)
        x = {k: take(v) for k, v in x.items()} if isinstance(x, Mapping) else take(x)
        yield x, take(y)
        seen += n


def _one(x: Any, i: int) -> Any:
    return {k: v[i : i + 1] for k, v in x.items()} if isinstance(x, Mapping) else x[i : i + 1]


@contextmanager
def _scoring_mode(model: nn.Module, params: Sequence[nn.Parameter]) -> Iterator[None]:
    """eval() (no dropout) and requires_grad on `params` for the duration; both restored afterwards."""
    was_training = model.training
    flags = [p.requires_grad for p in params]
    model.eval()
    for p in params:
        p.requires_grad_(True)
    try:
        yield
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
        model.train(was_training)


def layer_importance(
    model: nn.Module,
    batches: Iterable[tuple[Any, torch.Tensor]],
    loss_fn: LossFn = classification_loss,
    *,
    method: Literal["fisher", "taylor"] = "fisher",
    over: Literal["all", "trainable"] = "all",
    max_samples: int | None = None,
) -> list[float]:
    """One score per layer from the site's data (x, y batches; loss_fn returns the batch-mean loss).

    fisher: empirical Fisher trace of the layer, s_l = sum_{p in l} mean_i (dL_i/dtheta_p)^2, with per-sample
        gradients of the per-sample loss (-log p(y_i|x_i) for classification), one backward per sample.
    taylor: first-order Taylor, s_l = |sum_{p in l} theta_p * g_p| with g the gradient of the mean loss over
        all samples: the predicted loss change of removing the layer's parameters.
    over: "all" scores every parameter of the layer (also frozen base weights under LoRA, where a LoRA B of
        zero would make trainable-only Taylor scores identically 0); "trainable" only federated trainable ones.
    The model's .grad fields, requires_grad flags and train/eval mode are left as they were.
    """
    if method not in ("fisher", "taylor"):
        raise ValueError(f"method must be 'fisher' or 'taylor', got {method!r}")
    if over not in ("all", "trainable"):
        raise ValueError(f"over must be 'all' or 'trainable', got {over!r}")
    arch = find_architecture(model)
    named = [
        (arch.layer_of(n), p)
        for n, p in model.named_parameters()
        if arch.layer_of(n) is not None and (over == "all" or _federated(p))
    ]
    if not named:
        raise ValueError("no parameters to score inside the layers")
    params = [p for _, p in named]
    acc = [torch.zeros((), dtype=torch.float64) for _ in params]
    total = 0
    with _scoring_mode(model, params):
        for x, y in _samples(batches, max_samples):
            if method == "fisher":
                for i in range(len(y)):
                    grads = torch.autograd.grad(loss_fn(model, _one(x, i), y[i : i + 1]), params, allow_unused=True)
                    for j, g in enumerate(grads):
                        if g is not None:
                            acc[j] += g.double().pow(2).sum()
            else:
                grads = torch.autograd.grad(loss_fn(model, x, y), params, allow_unused=True)
                for j, (g, p) in enumerate(zip(grads, params)):
                    if g is not None:
                        acc[j] += len(y) * (g.double() * p.detach().double()).sum()
            total += len(y)
    if total == 0:
        raise ValueError("no samples to score on")
    sums = [torch.zeros((), dtype=torch.float64) for _ in range(arch.num_layers)]
    for (layer, _), a in zip(named, acc):
        sums[layer] += a
    # fisher: trace of the layer's empirical Fisher; taylor: |theta . mean gradient| of the layer.
    return [float(s) / total if method == "fisher" else abs(float(s)) / total for s in sums]


class _HeadGates:
    """Forward pre-hook on o: multiplies each sample's head group g by a gate xi[b, g] = 1 that requires grad,
    so dL/dxi[b, g] = A_g(x_b)^T dL/dA_g(x_b) (Michel et al.) per sample, in one backward pass."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.gates: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        gate = torch.ones(x.shape[0], self.num_groups, dtype=x.dtype, device=x.device, requires_grad=True)
        self.gates.append(gate)
        view = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.num_groups, 1)
        return ((x.unflatten(-1, (self.num_groups, -1)) * gate.view(view)).flatten(-2), *args[1:])


@contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Run the model's attention with the eager implementation (which returns attention weights)."""
    from transformers import PreTrainedModel

    configs = {id(m.config): m.config for m in model.modules() if isinstance(m, PreTrainedModel)}
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs.setdefault(id(config), config)
    saved = [(c, c._attn_implementation) for c in configs.values()]
    try:
        for c, _ in saved:
            c._attn_implementation = "eager"
        yield
    finally:
        for c, impl in saved:
            c._attn_implementation = impl


def head_importance(
    model: nn.Module,
    batches: Iterable[tuple[Any, torch.Tensor]],
    loss_fn: LossFn = classification_loss,
    *,
    method: Literal["taylor", "confidence"] = "taylor",
    max_samples: int | None = None,
) -> list[list[float]]:
    """Per layer, one score per head (per KV group under grouped-query attention).

    taylor: gate-gradient importance I_g = E_x |dL(x)/dxi_g| with a gate xi_g = 1 on the group's head outputs
        before o (= E_x |A_g(x)^T dL/dA_g(x)|); per-sample values from per-sample gates (batch-mean loss x
        batch size = the sample's own loss when the loss is a mean over samples).
    confidence: mean over samples and query positions of the head's largest attention weight (Voita et al.),
        averaged over the query heads of a group; runs the attention in eager mode to get the weights.
    Model .grad fields, requires_grad flags and train/eval mode are left as they were.
    """
    arch = find_architecture(model)
    if method not in ("taylor", "confidence"):
        raise ValueError(f"method must be 'taylor' or 'confidence', got {method!r}")
    acc = torch.zeros(arch.num_layers, arch.num_groups, dtype=torch.float64)
    total = 0
    hooks = []
    if method == "taylor":
        gates = [_HeadGates(arch.num_groups) for _ in arch.layers]
        hooks = [model.get_submodule(ref.o).register_forward_pre_hook(g) for ref, g in zip(arch.layers, gates)]
        try:
            with _scoring_mode(model, []):
                for x, y in _samples(batches, max_samples):
                    for g in gates:
                        g.gates.clear()
                    loss = loss_fn(model, x, y) * len(y)
                    used = [(i, g.gates[-1]) for i, g in enumerate(gates) if g.gates]
                    grads = torch.autograd.grad(loss, [gate for _, gate in used], allow_unused=True)
                    for (i, _), grad in zip(used, grads):
                        if grad is not None:
                            acc[i] += grad.detach().double().abs().sum(0)
                    total += len(y)
        finally:
            for h in hooks:
                h.remove()
    else:
        captured: dict[int, torch.Tensor] = {}

        def capture(index: int) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
                if weights is None:
                    raise RuntimeError(f"layer {index} attention returned no weights even in eager mode")
                captured[index] = weights.detach()

            return hook

        hooks = [model.get_submodule(ref.attention).register_forward_hook(capture(ref.index)) for ref in arch.layers]
        try:
            with _scoring_mode(model, []), eager_attention(model), torch.no_grad():
                for x, y in _samples(batches, max_samples):
                    captured.clear()
                    loss_fn(model, x, y)
                    for i, w in captured.items():  # w: [batch, heads, queries, keys]
                        per_head = w.double().amax(-1).mean(-1).sum(0)  # [heads], summed over the batch
                        acc[i] += per_head.view(arch.num_groups, arch.group_size).mean(-1)
                    total += len(y)
        finally:
            for h in hooks:
                h.remove()
    if total == 0:
        raise ValueError("no samples to score on")
    return (acc / total).tolist()


# --------------------------------------------------------------------------------------------------------------
# Coordinator side: rankings, selections, budgets
# --------------------------------------------------------------------------------------------------------------


def global_layer_scores(
    site_scores: Sequence[tuple[Sequence[float], float]], *, normalize: bool = False
) -> list[float]:
    """S_l = sum_k n_k s_l^(k) / sum_k n_k. `normalize` first divides each site's vector by its sum, so a site
    whose loss scale is larger does not dominate (off by default, as in the design notes)."""
    if not site_scores:
        raise ValueError("no site scores to combine")
    length = len(site_scores[0][0])
    total_n = 0.0
    combined = [0.0] * length
    for k, (scores, n) in enumerate(site_scores):
        if len(scores) != length:
            raise ValueError(f"site {k} sent {len(scores)} layer scores, expected {length}")
        if not n > 0:
            raise ValueError(f"site {k} has sample weight {n}; weights must be > 0")
        if not all(math.isfinite(s) and s >= 0 for s in scores):
            raise ValueError(f"site {k} sent non-finite or negative scores: {list(scores)}")
        scale = sum(scores) if normalize else 1.0
        scale = scale if scale > 0 else 1.0
        for l, s in enumerate(scores):
            combined[l] += n * s / scale
        total_n += n
    return [c / total_n for c in combined]


def combine_layer_scores(
    site_scores: Sequence[tuple[Sequence[float], float]], *, normalize: bool = False
) -> list[int]:
    """Global layer ranking (most important first; ties to the lower index) from (scores, n_samples) per site."""
    combined = global_layer_scores(site_scores, normalize=normalize)
    return sorted(range(len(combined)), key=lambda l: (-combined[l], l))


def select_heads(scores: Sequence[float], k: int) -> tuple[int, ...]:
    """Indices of the k highest-scoring heads (KV groups), ascending; ties go to the lower index."""
    if not 1 <= k <= len(scores):
        raise ValueError(f"k must be in 1..{len(scores)}, got {k}")
    order = sorted(range(len(scores)), key=lambda h: (-scores[h], h))
    return tuple(sorted(order[:k]))


def build_spec(
    ranking: Sequence[int],
    num_layers: int,
    head_scores: Sequence[Sequence[float]] | None = None,
    heads_per_layer: int | None = None,
    **kwargs: Any,
) -> SubnetSpec:
    """Top-`num_layers` layers of the global ranking (nested across sites), and in each the site's top
    `heads_per_layer` heads by its own `head_scores[layer]` (all heads when either is None)."""
    if not 1 <= num_layers <= len(ranking):
        raise ValueError(f"num_layers must be in 1..{len(ranking)}, got {num_layers}")
    layers = tuple(sorted(ranking[:num_layers]))
    heads = None
    if head_scores is not None and heads_per_layer is not None:
        heads = tuple(select_heads(head_scores[layer], heads_per_layer) for layer in layers)
    return SubnetSpec(layers=layers, heads=heads, **kwargs)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Cost of one local step, measured on the reference device (speed 1.0).

    fixed_s / fixed_bytes: step time / peak memory with no trained layer (weights, embeddings, head, the
        forward of frozen layers, their activations).
    per_layer_s / per_layer_bytes: what each trained layer with all heads adds (backward, grads, optimizer
        state, stored activations).
    head_fraction: share of the per-layer cost that scales with the kept heads (q/k/v/o and attention; e.g.
        from FLOP counts: `model_zoo.forward_flops`); the rest (FFN, norms) does not.
    """

    fixed_s: float
    per_layer_s: float
    fixed_bytes: float
    per_layer_bytes: float
    head_fraction: float = 0.35

    def __post_init__(self) -> None:
        if min(self.fixed_s, self.per_layer_s, self.fixed_bytes, self.per_layer_bytes) < 0:
            raise ValueError("costs must be >= 0")
        if not 0.0 <= self.head_fraction <= 1.0:
            raise ValueError(f"head_fraction must be in [0, 1], got {self.head_fraction}")

    def work(self, layers: int, heads: int, num_groups: int) -> float:
        """Trained-layer equivalents: L * ((1 - f) + f * H / H_max)."""
        return layers * ((1.0 - self.head_fraction) + self.head_fraction * heads / num_groups)


COST_FIELDS = ("fixed_s", "per_layer_s", "fixed_bytes", "per_layer_bytes")
"""The measured LayerCost fields a site reports (as `cost.fixed-s`, ...) in its scores reply."""


@dataclass(frozen=True)
class Budget:
    layers: int
    heads: int
    step_s: float
    """Estimated step time on the site's device."""
    memory_bytes: float
    """Estimated peak memory."""


def plan_budget(
    cost: LayerCost,
    *,
    num_layers: int,
    num_groups: int,
    memory_bytes: float,
    speed: float,
    deadline_s: float,
    local_steps: int,
) -> Budget:
    """Largest Hydra-net (layers L, heads per layer H) that fits a site.

    Model: w = L * ((1 - f) + f * H / H_max) trained-layer equivalents;
        step_s = (fixed_s + w * per_layer_s) / speed;     memory = fixed_bytes + w * per_layer_bytes;
    feasible when local_steps * step_s <= deadline_s and memory <= memory_bytes. Picks the feasible (L, H)
    with the largest w, ties to more layers. Raises ValueError when even (1 layer, 1 head) does not fit.
    """
    if speed <= 0 or deadline_s <= 0 or local_steps <= 0:
        raise ValueError("speed, deadline_s and local_steps must be > 0")
    best: Budget | None = None
    best_key = (-1.0, -1)
    for layers in range(1, num_layers + 1):
        for heads in range(1, num_groups + 1):
            w = cost.work(layers, heads, num_groups)
            step_s = (cost.fixed_s + w * cost.per_layer_s) / speed
            mem = cost.fixed_bytes + w * cost.per_layer_bytes
            if local_steps * step_s <= deadline_s and mem <= memory_bytes:
                key = (round(w, 12), layers)
                if key > best_key:
                    best_key, best = key, Budget(layers, heads, step_s, mem)
    if best is None:
        w = cost.work(1, 1, num_groups)
        need_s = local_steps * (cost.fixed_s + w * cost.per_layer_s) / speed
        need_bytes = cost.fixed_bytes + w * cost.per_layer_bytes
        raise ValueError(
            f"no Hydra-net fits: 1 layer / 1 head needs {need_s:.3g} s (deadline {deadline_s} s) "
            f"and {need_bytes:.4g} bytes (site has {memory_bytes})"
        )
    return best


def measure_layer_cost(
    model: nn.Module,
    loss: Callable[[], torch.Tensor],
    optimizer: str,
    *,
    speed: float = 1.0,
    repeats: int = 2,
    bypass: bool = False,
) -> LayerCost:
    """A site's LayerCost, measured on its own model and data: one training step (forward + backward) with only
    the top layer trained and with every layer trained; memory from `hydrafl.footprint` (exact, so a memory
    budget is deterministic), time the best of `repeats` steps divided by `speed` (a declared slowdown, to
    emulate slower hardware in simulation; 1.0 on a real site, which measures its own device). With `bypass`
    the untrained layers are skipped as a bypassing Hydra-net skips them: their compute and activations leave
    the fixed cost (their weights stay in memory, and in it)."""
    if speed <= 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    arch = find_architecture(model)
    num_layers = len(arch.layers)

    def step(layers: tuple[int, ...]) -> tuple[float, float]:
        with apply_spec(model, SubnetSpec(layers=layers, bypass=bypass), arch):
            peak = training_footprint(model, loss, optimizer).peak_bytes
            seconds = []
            with torch.random.fork_rng(devices=[]):
                for _ in range(repeats + 1):  # the first step warms up kernels and allocator
                    started = time.perf_counter()
                    loss().backward()
                    seconds.append(time.perf_counter() - started)
            model.zero_grad(set_to_none=True)
        return min(seconds[1:]) / speed, float(peak)

    top_s, top_bytes = step((num_layers - 1,))
    if num_layers == 1:
        return LayerCost(fixed_s=top_s / 2, per_layer_s=top_s / 2, fixed_bytes=top_bytes / 2, per_layer_bytes=top_bytes / 2)
    all_s, all_bytes = step(tuple(range(num_layers)))
    per_layer_s = max(all_s - top_s, 0.0) / (num_layers - 1)
    per_layer_bytes = max(all_bytes - top_bytes, 0.0) / (num_layers - 1)
    return LayerCost(
        fixed_s=max(top_s - per_layer_s, 0.0),
        per_layer_s=per_layer_s,
        fixed_bytes=max(top_bytes - per_layer_bytes, 0.0),
        per_layer_bytes=per_layer_bytes,
    )


__all__ = [
    "PATTERNS",
    "Architecture",
    "Budget",
    "COST_FIELDS",
    "measure_layer_cost",
    "FFN_PATTERNS",
    "LayerCost",
    "LayerRef",
    "Slice",
    "SpecError",
    "SubnetHandle",
    "SubnetSpec",
    "apply_spec",
    "build_spec",
    "classification_loss",
    "combine_layer_scores",
    "coordinate_masks",
    "eager_attention",
    "extract",
    "ffn_width_axis",
    "find_architecture",
    "global_layer_scores",
    "head_axis_of",
    "head_importance",
    "layer_importance",
    "merge",
    "payload_bytes",
    "plan_budget",
    "read_slices",
    "select_heads",
    "trainable_slices",
    "WidthAxis",
    "width_for_budget",
    "width_layout",
    "width_layout_from_heads",
    "width_slices",
    "width_window",
]
