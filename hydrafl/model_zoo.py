"""Models the Hydra-net work needs beyond `hydrafl.models`: a tiny Llama-style causal LM, PEFT LoRA wrapping,
offline loading of a local checkpoint, and parameter / byte / FLOP counts per model and per subnetwork.

FLOP formula (forward, one sequence of S tokens; `forward_flops`):

    F = 2 * S * W  +  sum over computed layers of  4 * S^2 * h * d

- W: weight elements of every nn.Linear / nn.Conv (LoRA base_layer, lora_A and lora_B included, the inactive
  `original_module` copy of a PEFT-saved head excluded) touched per token; one multiply-add = 2 FLOPs.
  Modules outside the transformer layers (LM head, classifier, pooler, ViT patch projection) are counted once
  per token: exact for an LM head, an upper bound for a head that only reads the pooled token.
- 4 * S^2 * h * d: attention scores (Q K^T, 2 S^2 d per head) and the weighted sum of values (2 S^2 d), for the
  h query heads of width d computed in the layer; dense S x S as the kernels execute it (causal included).
- Ignored (O(S * hidden)): embeddings lookups, biases, norms, activations, softmax, residual adds.
- Per subnetwork: bypassed layers cost 0. `executed=True` counts what `hydranet.apply_spec` runs (frozen layers
  and masked heads or widths are still computed); `executed=False` counts the pruned subnetwork (the kept heads'
  share of the q/k/v rows and o columns, and of the attention term, in the selected layers; for a width spec
  the kept share of each head's dims and of the FFN hidden units, `width_window`, at the spec's widest).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from hydrafl.hydranet import (
    Architecture,
    SubnetSpec,
    ffn_width_axis,
    find_architecture,
    head_axis_of,
    trainable_slices,
    width_window,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyLlamaShape:
    """A Llama-style decoder small enough for CPU simulations; grouped-query attention by default."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    max_positions: int = 256


def build_causal_lm(vocab_size: int, *, shape: TinyLlamaShape = TinyLlamaShape(), seed: int = 0) -> LlamaForCausalLM:
    """A seeded, randomly initialised LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, GQA, untied LM head)."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    if shape.hidden % shape.heads or shape.heads % shape.kv_heads:
        raise ValueError(f"hidden {shape.hidden} / heads {shape.heads} / kv_heads {shape.kv_heads} do not divide")
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=shape.max_positions,
        tie_word_embeddings=False,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


# Attention projections per architecture family, as PEFT `target_modules` (regex, full match on module names).
LORA_TARGETS = {
    "bert": r".*\.attention\.(self\.(query|key|value)|output\.dense)",
    "vit": r".*\.attention\.(q_proj|k_proj|v_proj|o_proj)",
    "llama": r".*\.self_attn\.(q_proj|k_proj|v_proj|o_proj)",
}


def with_lora(
    model: nn.Module,
    rank: int = 8,
    alpha: float = 16.0,
    target_modules: list[str] | str | None = None,
    *,
    dropout: float = 0.0,
    modules_to_save: list[str] | None | str = "auto",
    init_lora_weights: bool = True,
) -> nn.Module:
    """Wrap `model` with PEFT LoRA; afterwards only the LoRA factors (and `modules_to_save`) require grad, and
    those are the federated coordinates (`hydrafl.models.federated_state`).

    target_modules: default = the q/k/v/o attention projections of the detected family (`LORA_TARGETS`).
    modules_to_save: "auto" keeps a module named `classifier` trainable when there is one (BERT/ViT
        classification heads; a causal LM's lm_head stays frozen); None for none.
    init_lora_weights: False initialises B randomly too (useful in tests; PEFT's default makes B = 0).
    """
    from peft import LoraConfig, get_peft_model

    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if target_modules is None:
        target_modules = LORA_TARGETS[find_architecture(model).family]
    if modules_to_save == "auto":
        has_classifier = any(name.rsplit(".", 1)[-1] == "classifier" for name, _ in model.named_modules())
        modules_to_save = ["classifier"] if has_classifier else None
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=dropout,
        modules_to_save=modules_to_save,
        init_lora_weights=init_lora_weights,
    )
    return get_peft_model(model, config)


def load_pretrained(path: str | Path, *, model_class: type[PreTrainedModel] | None = None, **kwargs) -> PreTrainedModel:
    """Load a local checkpoint directory offline (`local_files_only=True`; never a hub download).

    The class is `model_class`, else the first entry of the checkpoint's `config.json` "architectures" when
    transformers has it (e.g. LlamaForCausalLM, BertModel), else AutoModel."""
    import transformers

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a local checkpoint directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{str(path)!r} has no config.json; save it with `model.save_pretrained(path)`")
    if model_class is None:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        model_class = model_class or AutoModel
    return model_class.from_pretrained(path, local_files_only=True, **kwargs)


# --------------------------------------------------------------------------------------------------------------
# Counts
# --------------------------------------------------------------------------------------------------------------


def parameter_count(model: nn.Module, spec: SubnetSpec | None = None, *, trainable_only: bool = True) -> int:
    """Elements of the (trainable) parameters; with `spec`, of the coordinates the subnetwork trains."""
    if spec is not None:
        if not trainable_only:
            raise ValueError("a subnetwork count is a count of trained coordinates: use trainable_only=True")
        params = dict(model.named_parameters())
        return sum(sl.numel(params[name].shape) for name, sl in trainable_slices(model, spec).items())
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def parameter_bytes(model: nn.Module, spec: SubnetSpec | None = None, *, trainable_only: bool = True) -> int:
    """Like `parameter_count`, in bytes of each tensor's dtype (what a full or sliced payload carries)."""
    if spec is not None:
        if not trainable_only:
            raise ValueError("a subnetwork count is a count of trained coordinates: use trainable_only=True")
        params = dict(model.named_parameters())
        return sum(
            sl.numel(params[name].shape) * params[name].element_size()
            for name, sl in trainable_slices(model, spec).items()
        )
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad or not trainable_only)


def _matmul_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and ".original_module" not in f".{name}"
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
            elif role is not None and axis is not None and (kept := spec.heads_for(layer)) is not None:
                fraction = len(kept) / arch.num_groups
        touched += numel * fraction
    attention = 0
    for ref in arch.layers:
        heads = arch.num_heads
        if spec is not None:
            if spec.bypass and ref.index not in spec.layers:
                continue
            if not executed and ref.index in spec.layers and spec.heads_for(ref.index) is not None:
                heads = len(spec.heads_for(ref.index)) * arch.group_size
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


__all__ = [
    "LORA_TARGETS",
    "TinyLlamaShape",
    "build_causal_lm",
    "forward_flops",
    "load_pretrained",
    "parameter_bytes",
    "parameter_count",
    "with_lora",
]
