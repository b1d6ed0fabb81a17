"""The transformer backbones every task model is built on: the seeded tiny shapes (`TinyShape`), the tiny
Llama-style causal LM, PEFT LoRA wrapping (`LoraSpec`, `with_lora`), and offline loading of a local checkpoint.

`hydrafl.models` (classifiers) and `hydrafl.causal_lm` (next-token LMs) both build on this module and never on
each other's internals.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
)

from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.families import PATTERNS


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyShape:
    """Size of a from-scratch model (BERT or ViT encoder, Llama-style LM); small enough for a CPU simulation of
    many sites."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int | None = None
    """KV heads of the Llama-style LM (grouped-query attention); None: half the heads when even, else all."""
    intermediate: int = 128
    patch_size: int = 8
    """ViT patch side, in pixels."""
    max_positions: int = 256
    """Positions of the Llama-style LM; a next-token task widens it to its sequence length."""
    experts: int = 8
    """Experts per layer of the mixture-of-experts LM."""
    experts_per_token: int = 2
    """Experts the router picks for each token (top-k) in the mixture-of-experts LM."""

    @property
    def num_kv_heads(self) -> int:
        """The Llama-style LM's KV heads, `kv_heads` or its default."""
        if self.kv_heads is not None:
            return self.kv_heads
        return self.heads // 2 if self.heads % 2 == 0 else self.heads


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """PEFT LoRA on top of the model; hashable, so a process can cache one model per spec."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = ()
    """Module-name suffixes to adapt (e.g. "query", "value"); () = the q/k/v/o attention projections."""

    def __post_init__(self) -> None:
        if self.rank < 1 or self.alpha <= 0:
            raise ValueError(
                f"LoRA needs rank >= 1 and alpha > 0, got rank={self.rank}, alpha={self.alpha}"
            )


def _decoder_config(vocab_size: int, shape: TinyShape, seed: int) -> dict[str, Any]:
    """The config keys the tiny decoder LMs share (checked), after seeding the weights they will draw."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    kv_heads = shape.num_kv_heads
    if shape.hidden % shape.heads or shape.heads % kv_heads:
        raise ValueError(
            f"hidden {shape.hidden} / heads {shape.heads} / kv_heads {kv_heads} do not divide"
        )
    torch.manual_seed(seed)
    return {
        "vocab_size": vocab_size,
        "hidden_size": shape.hidden,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": kv_heads,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": False,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


def build_causal_lm(
    vocab_size: int, *, shape: TinyShape = TinyShape(), seed: int = 0
) -> LlamaForCausalLM:
    """A seeded, randomly initialised LlamaForCausalLM (RoPE, RMSNorm, SwiGLU, GQA, untied LM head)."""
    return LlamaForCausalLM(LlamaConfig(**_decoder_config(vocab_size, shape, seed)))


def build_moe_lm(
    vocab_size: int, *, shape: TinyShape = TinyShape(), seed: int = 0
) -> MixtralForCausalLM:
    """A seeded, randomly initialised MixtralForCausalLM: the Llama-style LM with each FFN replaced by
    `shape.experts` SwiGLU experts of `shape.intermediate` units and a top-`shape.experts_per_token` router."""
    if not 1 <= shape.experts_per_token <= shape.experts:
        raise ValueError(
            f"experts_per_token must be in 1..{shape.experts}, got {shape.experts_per_token}"
        )
    config = _decoder_config(vocab_size, shape, seed)
    return MixtralForCausalLM(
        MixtralConfig(
            **config,
            num_local_experts=shape.experts,
            num_experts_per_tok=shape.experts_per_token,
        )
    )


LORA_TARGETS = {
    p.family: r".*\.(" + "|".join(re.escape(path) for path in (p.q, p.k, p.v, p.o)) + ")"
    for p in PATTERNS
}
"""Attention projections per model family (`subnet.families`), as PEFT `target_modules` (regex, full match on
module names)."""


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
        has_classifier = any(
            name.rsplit(".", 1)[-1] == "classifier" for name, _ in model.named_modules()
        )
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


def load_pretrained(
    path: str | Path, *, model_class: type[PreTrainedModel] | None = None, **kwargs: Any
) -> PreTrainedModel:
    """Load a local checkpoint directory offline (`local_files_only=True`; never a hub download).

    The class is `model_class`, else the first entry of the checkpoint's `config.json` "architectures" when
    transformers has it (e.g. LlamaForCausalLM, BertModel), else AutoModel."""
    import transformers

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{str(path)!r} is not a local checkpoint directory")
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{str(path)!r} has no config.json; save it with `model.save_pretrained(path)`"
        )
    if model_class is None:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        names = getattr(config, "architectures", None) or []
        model_class = getattr(transformers, names[0], None) if names else None
        model_class = model_class or AutoModel
    return model_class.from_pretrained(path, local_files_only=True, **kwargs)


__all__ = [
    "LORA_TARGETS",
    "LoraSpec",
    "TinyShape",
    "build_causal_lm",
    "build_moe_lm",
    "load_pretrained",
    "with_lora",
]
