"""Where a live Hugging Face transformer keeps its layers and attention projections (`find_architecture`), and
which head a parameter's coordinates belong to (`head_axis_of`): BERT, ViT and Llama-style models, plain or
wrapped by PEFT LoRA.

Head layout. Every supported attention concatenates head outputs head-major before the output projection:
the input of o is [..., num_heads * head_dim] and head h owns dims [h*d, (h+1)*d). Under grouped-query
attention query head h reads KV head h // (num_heads // num_kv_heads) (transformers' `repeat_kv`), so the unit
of selection is the KV group: keeping group g keeps KV head g and query heads g*r .. g*r + r - 1.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

from hydrafl.subnet.families import EXPERT_ROUTER, PATTERNS, FamilyPattern, projection_axis


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
    """A model's transformer layers and their attention shape, as the subnetwork code addresses them."""

    family: str  # "bert", "vit" or "llama" (any `self_attn.{q,k,v,o}_proj` decoder)
    layers_name: str  # the nn.ModuleList holding the layers
    layers: tuple[LayerRef, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_experts: int = 0
    """Experts per layer of a mixture-of-experts model (`families.EXPERT_ROUTER`); 0 without experts."""

    @property
    def num_layers(self) -> int:
        """Transformer layers of the model."""
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
        """The query heads that read KV group `group`."""
        return range(group * self.group_size, (group + 1) * self.group_size)

    def query_dims(self, groups: Iterable[int]) -> list[int]:
        """Dims of the q output / o input owned by the query heads of `groups`."""
        d = self.head_dim
        return [
            i
            for g in sorted(groups)
            for h in self.query_heads(g)
            for i in range(h * d, (h + 1) * d)
        ]

    def kv_dims(self, groups: Iterable[int]) -> list[int]:
        """Dims of the k/v outputs owned by the KV heads of `groups`."""
        d = self.head_dim
        return [i for g in sorted(groups) for i in range(g * d, (g + 1) * d)]

    def layer_of(self, name: str) -> int | None:
        """Layer index of a parameter or module name, or None if it lies outside the layers."""
        if not name.startswith(self.layers_name + "."):
            return None
        rest = name[len(self.layers_name) + 1 :]
        head = rest.split(".", 1)[0]
        return int(head) if head.isdigit() and int(head) < len(self.layers) else None


def has_module(module: nn.Module, path: str) -> bool:
    """Whether `module` has a submodule at the dotted `path`."""
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
    found: list[tuple[str, nn.ModuleList, FamilyPattern]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        for pattern in PATTERNS:
            if all(
                all(has_module(child, p) for p in (pattern.q, pattern.k, pattern.v, pattern.o))
                for child in module
            ):
                found.append((name, module, pattern))
    if not found:
        raise ValueError(
            f"no supported transformer layer list in {type(model).__name__}; supported layer contents: "
            + "; ".join(f"{p.family}: {p.q}, {p.k}, {p.v}, {p.o}" for p in PATTERNS)
        )
    if len(found) > 1:
        raise ValueError(
            f"several transformer layer lists found ({[f[0] for f in found]}); only one is supported"
        )
    list_name, layer_list, pattern = found[0]
    layers, shapes = [], set()
    for i, layer in enumerate(layer_list):
        base = f"{list_name}.{i}"
        attention = layer.get_submodule(pattern.attention)
        head_dim = getattr(attention, "head_dim", None) or getattr(
            attention, "attention_head_size", None
        )
        q = _base_linear(layer.get_submodule(pattern.q))
        k = _base_linear(layer.get_submodule(pattern.k))
        o = _base_linear(layer.get_submodule(pattern.o))
        if not head_dim or q.out_features % head_dim or k.out_features % head_dim:
            raise ValueError(
                f"cannot infer the head size of layer {i} ({type(attention).__name__})"
            )
        shapes.add(
            (q.out_features // head_dim, k.out_features // head_dim, int(head_dim), o.out_features)
        )
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
    experts = {
        int(layer.get_parameter(f"{EXPERT_ROUTER}.weight").shape[0])
        for layer in layer_list
        if has_module(layer, EXPERT_ROUTER)
    }
    if len(experts) > 1 or (experts and not all(has_module(c, EXPERT_ROUTER) for c in layer_list)):
        raise ValueError(f"layers differ in their number of experts: {sorted(experts)}")
    return Architecture(
        pattern.family,
        list_name,
        tuple(layers),
        heads,
        kv_heads,
        head_dim,
        hidden,
        num_experts=experts.pop() if experts else 0,
    )


def head_axis_of(arch: Architecture, name: str) -> tuple[int | None, str | None, int | None]:
    """(layer, role in "q"/"k"/"v"/"o" or None, head axis or None) of a parameter name: the axis along which the
    tensor is indexed by head dims (see `families.projection_axis`), None when every element serves every head."""
    layer, role, suffix = _classify(arch, name)
    axis = None if role is None else projection_axis(role, suffix)
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


__all__ = ["Architecture", "LayerRef", "find_architecture", "has_module", "head_axis_of"]
