"""The model families hydrafl supports, as plain data: where a transformer layer keeps its attention projections
and its FFN, and which axis of each projection tensor a head owns.

It imports no torch, so the coordinator's width math (`subnet.width`) reads the same table the site's
architecture adapter (`subnet.architecture`) and the LoRA targets (`hydrafl.backbones`) are derived from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FamilyPattern:
    """Module paths, relative to one transformer layer, of a family's attention and its q/k/v/o projections."""

    family: str
    attention: str  # module (relative to a layer) whose forward returns (output, attention weights)
    q: str
    k: str
    v: str
    o: str


# Module paths relative to one entry of the model's layer list (transformers 5.x). PEFT LoRA keeps these module
# paths (the Linear becomes a LoRA wrapper holding `base_layer`, `lora_A.<adapter>`, `lora_B.<adapter>`), and
# only prefixes the layer list's path with `base_model.model.`.
PATTERNS: tuple[FamilyPattern, ...] = (
    FamilyPattern(
        "bert",
        "attention.self",
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
    ),
    FamilyPattern(
        "vit",
        "attention",
        "attention.q_proj",
        "attention.k_proj",
        "attention.v_proj",
        "attention.o_proj",
    ),
    FamilyPattern(
        "llama",
        "self_attn",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
    ),
)

FFN_PATTERNS: Mapping[str, tuple[tuple[str, ...], str]] = {
    "bert": (("intermediate.dense",), "output.dense"),
    "vit": (("mlp.fc1",), "mlp.fc2"),
    "llama": (("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj"),
}
"""Per family, FFN module paths relative to a layer: the projections into the hidden units, the one out of them."""


EXPERT_ROUTER = "mlp.gate"
"""Module path, relative to a layer, of a mixture-of-experts router (Mixtral family, transformers 5.x): its
forward returns (router logits, top-k weights, top-k expert indices [tokens, k])."""
EXPERT_TENSORS: tuple[str, ...] = (
    "mlp.gate.weight",
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
)
"""Parameter paths, relative to a layer, indexed by expert along axis 0: the router's rows ([experts, hidden])
and the experts' stacked weights ([experts, ...])."""


def is_expert_tensor(name: str) -> bool:
    """Whether the parameter `name` is indexed by expert along axis 0 (`EXPERT_TENSORS`). By name alone, so
    the coordinator slices experts out of named arrays without any model code."""
    return any(name.endswith("." + path) for path in EXPERT_TENSORS)


# Part of a projection a parameter belongs to, from its name suffix after the projection's module name.
#   weight / bias / base_layer.weight / base_layer.bias -> "base";  lora_A.<adapter>.weight -> "A";
#   lora_B.<adapter>.weight -> "B";  lora_magnitude_vector.<adapter>.weight (DoRA) -> "magnitude"; else None.
def _part(suffix: str) -> str | None:
    if suffix in ("weight", "bias", "base_layer.weight", "base_layer.bias"):
        return "base"
    head = suffix.split(".", 1)[0]
    return {"lora_A": "A", "lora_B": "B", "lora_magnitude_vector": "magnitude"}.get(head)


def projection_axis(role: str, suffix: str) -> int | None:
    """Axis of a q/k/v/o tensor (named by `suffix` after its projection's module name) that is indexed by head
    dims, or None if every element serves every head.

    q/k/v: output rows are per head: base weight and bias rows, LoRA B rows, DoRA magnitude. LoRA A (r x in)
    feeds every output row: shared. o: input columns are per head: base weight columns and LoRA A columns
    (A is r x (heads*head_dim), its column j multiplies head-dim j of the input); o bias, LoRA B (out x r)
    and the DoRA magnitude (per output row) are shared."""
    part = _part(suffix)
    if part is None:
        return None
    if role in ("q", "k", "v"):
        return 0 if part in ("base", "B", "magnitude") else None
    if part == "base":
        return 1 if suffix.endswith("weight") else None
    return 1 if part == "A" else None


__all__ = [
    "EXPERT_ROUTER",
    "EXPERT_TENSORS",
    "FFN_PATTERNS",
    "PATTERNS",
    "FamilyPattern",
    "is_expert_tensor",
    "projection_axis",
]
