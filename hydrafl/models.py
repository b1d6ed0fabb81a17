"""Transformer classifiers for each data modality, built from a tiny config or a local checkpoint.

Every model is a Hugging Face transformers model behind one `Classifier` interface (features -> logits),
so the trainer, the apps and the strategies never branch on the modality. Hospitals with real weights
point `model` at a local directory (`from_pretrained`, offline); everything else starts from a seeded
tiny config so runs are reproducible without any download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import (
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    ViTConfig,
    ViTForImageClassification,
)

from hydrafl.data import TaskSpec


@dataclass(frozen=True, kw_only=True, slots=True)
class TinyShape:
    """Size of the from-scratch encoder; small enough for a CPU simulation of many sites."""

    hidden: int = 64
    layers: int = 2
    heads: int = 4
    intermediate: int = 128
    patch_size: int = 8


class Classifier(nn.Module):
    """One forward signature for every modality: a batch of features in, class logits out."""

    def __init__(self, net: nn.Module, modality: str) -> None:
        super().__init__()
        self.net = net
        self.modality = modality

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.modality == "text":
            return self.net(input_ids=x, attention_mask=(x != 0).long()).logits
        if self.modality == "image":
            return self.net(pixel_values=x).logits
        return self.net(x)


class TabularTransformer(nn.Module):
    """FT-Transformer style: each numeric feature becomes a token (value * w_f + b_f), a CLS token
    is prepended, and a BERT encoder mixes them."""

    def __init__(self, num_features: int, num_classes: int, shape: TinyShape) -> None:
        super().__init__()
        config = _bert_config(vocab_size=2, max_positions=num_features + 1, num_classes=num_classes, shape=shape)
        self.feature_weight = nn.Parameter(torch.randn(num_features, shape.hidden) * 0.02)
        self.feature_bias = nn.Parameter(torch.zeros(num_features, shape.hidden))
        self.cls = nn.Parameter(torch.randn(1, 1, shape.hidden) * 0.02)
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.head = nn.Linear(shape.hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x[:, :, None] * self.feature_weight + self.feature_bias  # [B, F, H]
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], dim=1)  # [B, F+1, H]
        hidden = self.encoder(inputs_embeds=tokens).last_hidden_state
        return self.head(hidden[:, 0])


def _bert_config(*, vocab_size: int, max_positions: int, num_classes: int, shape: TinyShape) -> BertConfig:
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        intermediate_size=shape.intermediate,
        max_position_embeddings=max_positions,
        num_labels=num_classes,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
    )


def build_model(task: TaskSpec, *, model: str = "tiny", seed: int = 0, shape: TinyShape = TinyShape()) -> Classifier:
    """Build the task's classifier; `model` is "tiny" or a local checkpoint directory."""
    if model != "tiny":
        return Classifier(_from_pretrained(Path(model), task), task.modality)
    torch.manual_seed(seed)
    if task.modality == "text":
        config = _bert_config(
            vocab_size=task.vocab_size, max_positions=task.seq_len, num_classes=task.num_classes, shape=shape
        )
        net: nn.Module = BertForSequenceClassification(config)
    elif task.modality == "image":
        config = ViTConfig(
            image_size=task.image_size,
            patch_size=shape.patch_size,
            num_channels=task.channels,
            hidden_size=shape.hidden,
            num_hidden_layers=shape.layers,
            num_attention_heads=shape.heads,
            intermediate_size=shape.intermediate,
            num_labels=task.num_classes,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        net = ViTForImageClassification(config)
    elif task.modality == "tabular":
        net = TabularTransformer(task.num_features, task.num_classes, shape)
    else:
        raise ValueError(f"unknown modality {task.modality!r}; expected text, image or tabular")
    return Classifier(net, task.modality)


def _from_pretrained(path: Path, task: TaskSpec) -> nn.Module:
    """Load real weights from a local directory (never from a hub: sites are often air-gapped)."""
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither 'tiny' nor a local checkpoint directory")
    loaders = {"text": AutoModelForSequenceClassification, "image": AutoModelForImageClassification}
    if task.modality not in loaders:
        raise ValueError(f"pretrained checkpoints are supported for text and image tasks, not {task.modality!r}")
    return loaders[task.modality].from_pretrained(
        path, num_labels=task.num_classes, local_files_only=True, ignore_mismatched_sizes=True
    )


def federated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The coordinates the federation shares: every trainable parameter, by name."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
