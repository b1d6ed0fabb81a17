"""A run's final model in the forms a hospital loads without hydrafl.

- A transformers model (the tiny BERT and ViT classifiers, MiniLM, a local checkpoint, the Llama-style LM):
  its `save_pretrained` folder (config.json, model.safetensors, and MiniLM's tokenizer), loaded back with
  `AutoModelFor....from_pretrained(DIR)`.
- A LoRA run: a PEFT adapter folder (`adapter/`: adapter_config.json, adapter_model.safetensors) beside the
  base model it adapts (`base/`, a `save_pretrained` folder): `PeftModel.from_pretrained(base, DIR/adapter)`.
- hydrafl's own small models (the tabular transformer, the small CNN): `model.safetensors` with
  `architecture.json` (the class and the arguments that rebuild it), read with `safetensors` alone.

The model is built as the sites built it (the run's task, model, seed and LoRA settings) and loaded with the
run's final arrays; every array must land on a tensor of the model, and every trained tensor must come from
the arrays, or the export refuses (a run of sites with their own data: pass a sample of it, `data`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from hydrafl.causal_lm import CausalLM
from hydrafl.config import RunConfig
from hydrafl.data import TaskSpec, load_cohort
from hydrafl.data.text_cohort import MINILM, minilm_path, tokenizer_for
from hydrafl.models import (
    Classifier,
    SmallCNN,
    TabularTransformer,
    build_model,
    federated_state,
    lora_spec,
)

TRANSFORMERS = "transformers"
PEFT = "peft"
SAFETENSORS = "safetensors"
ARCHITECTURE_FILE = "architecture.json"
WEIGHTS_FILE = "model.safetensors"


class ExportError(ValueError):
    """The run's arrays do not make the model its configuration builds; says which and what to do."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Exported:
    kind: str
    """transformers, peft or safetensors: how to load it (README, "Use the final model")."""
    path: Path


def run_task(cfg: RunConfig, data: str = "") -> TaskSpec:
    """The task the run's sites trained: the synthetic cohort's, or that of `data` (a sample of the sites'
    own files, which the coordinator does not hold)."""
    tokenizer = tokenizer_for(cfg.model, data or cfg.data)
    cohort = load_cohort(
        cfg.task,
        num_sites=1,
        seed=cfg.seed,
        data_path=(data or cfg.data) or None,
        label_column=cfg.label_column or None,
        samples_per_site=2,
        text_tokenizer=tokenizer,
    )
    return cohort.task


def final_model(cfg: RunConfig, arrays: Mapping[str, torch.Tensor], task: TaskSpec) -> nn.Module:
    """The run's model as its sites build it, holding the run's final arrays."""
    model = build_model(task, model=cfg.model, seed=cfg.seed, lora=lora_spec(cfg))
    state = model.state_dict()
    unknown = sorted(set(arrays) - set(state))
    missing = sorted(set(federated_state(model)) - set(arrays))
    if unknown or missing:
        raise ExportError(
            f"the run's arrays do not fit the {cfg.model} model of task {task.name!r} "
            f"(unknown: {unknown[:3]}, missing: {missing[:3]}); for a run whose sites read their own "
            "files, pass a sample of their data (--data)"
        )
    for name, tensor in arrays.items():
        if tuple(state[name].shape) != tuple(tensor.shape):
            raise ExportError(
                f"array {name} has shape {tuple(tensor.shape)}, the model's is "
                f"{tuple(state[name].shape)}; for a run whose sites read their own files, pass a "
                "sample of their data (--data)"
            )
    model.load_state_dict(dict(arrays), strict=False)
    return model.eval()


def export_model(model: nn.Module, cfg: RunConfig, out: Path) -> Exported:
    """Write `model` (from `final_model`) to `out` in the form its kind loads without hydrafl."""
    net = model.net if isinstance(model, (Classifier, CausalLM)) else model
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(net, (TabularTransformer, SmallCNN)):
        save_file({k: v.contiguous() for k, v in net.state_dict().items()}, out / WEIGHTS_FILE)
        (out / ARCHITECTURE_FILE).write_text(json.dumps(_architecture(net), indent=1) + "\n")
        return Exported(kind=SAFETENSORS, path=out)
    if hasattr(net, "peft_config"):
        net.save_pretrained(out / "adapter")
        base = copy.deepcopy(net).unload()  # the frozen weights the adapter applies to
        base.save_pretrained(out / "base")
        return Exported(kind=PEFT, path=out)
    net.save_pretrained(out)
    if cfg.model == MINILM:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(minilm_path(), local_files_only=True).save_pretrained(out)
    return Exported(kind=TRANSFORMERS, path=out)


def _architecture(net: nn.Module) -> dict[str, object]:
    """What rebuilds one of hydrafl's small models around the exported weights."""
    if isinstance(net, SmallCNN):
        return {
            "class": "hydrafl.models.SmallCNN",
            "channels": net.features[0].in_channels,
            "num_classes": net.head.out_features,
            "width": net.width,
            "blocks": net.blocks,
            "norm_groups": net.norm_groups,
        }
    assert isinstance(net, TabularTransformer)
    config = net.encoder.config
    return {
        "class": "hydrafl.models.TabularTransformer",
        "num_features": net.feature_weight.shape[0],
        "num_classes": net.head.out_features,
        "shape": {
            "hidden": config.hidden_size,
            "layers": config.num_hidden_layers,
            "heads": config.num_attention_heads,
            "intermediate": config.intermediate_size,
        },
    }
