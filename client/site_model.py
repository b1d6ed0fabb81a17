"""A site's working model: one object per process and LoRA shape, loaded from each message's arrays (the whole
model, a subnetwork's slices, or a LoRA baseline's rank-r adapter)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

import torch
from flwr.app import ArrayRecord

from hydrafl import protocol
from hydrafl.arrays import from_record
from hydrafl.client.model_probes import slice_layout
from hydrafl.config import RunConfig
from hydrafl.data import TaskSpec
from hydrafl.models import Classifier, LoraSpec, build_model, lora_spec
from hydrafl.subnet.apply import trainable_slices
from hydrafl.subnet.slices import Slice, read_slices
from hydrafl.subnet.spec import SubnetSpec


@lru_cache(maxsize=8)
def _working_model(
    task: TaskSpec, model: str, seed: int, lora: LoraSpec | None, own_bases: bool
) -> Classifier:
    """One model object per process and LoRA shape (a LoRA baseline's site of rank r trains a rank-r adapter),
    reloaded from the message's arrays before every use. Messages that carry
    the frozen LoRA base weights (FLoRA merges into them) get a model of their own, so merged bases never
    leak into runs whose messages do not carry them."""
    return build_model(task, model=model, seed=seed, lora=lora)


def site_model(
    task: TaskSpec,
    cfg: RunConfig,
    arrays: ArrayRecord,
    spec: SubnetSpec | None = None,
    rank: int | None = None,
) -> Classifier:
    """The working model loaded with `arrays`: the whole model; with a subnetwork `spec` only what its forward
    pass reads (`subnet.slices.read_slices`; see `load_arrays`); with a LoRA baseline's `rank` a rank-`rank` adapter
    (`lora_spec`), sent exactly its factors."""
    own_bases = any(name.endswith(".base_layer.weight") for name in arrays)
    model = _working_model(task, cfg.model, cfg.seed, lora_spec(cfg, rank), own_bases)
    read = None
    if spec is not None:
        layout = slice_layout(model)  # the layers as the coordinator knows them
        layers = dict(
            zip(layout[protocol.LAYOUT_NAMES], layout[protocol.LAYOUT_LAYERS], strict=True)
        )
        read = read_slices(trainable_slices(model, spec), layers, spec)
    load_arrays(model, arrays, read)
    return model


def load_arrays(
    model: Classifier, arrays: ArrayRecord, read: Mapping[str, Slice] | None = None
) -> None:
    """Copy `arrays` into the model's parameters. Each array is a whole tensor or, for a tensor of `read`, exactly
    its slice; every tensor of `read` must arrive. Outside its slice a tensor is set to 0: nothing reads it
    (masked heads and widths are multiplied by 0), and a non-finite value left there by an earlier round that
    diverged would make that product NaN for good, since those coordinates are never sent again."""
    parameters = dict(model.named_parameters())
    unknown = sorted(set(arrays) - set(parameters))
    if unknown:
        raise ValueError(f"arrays {unknown[:3]} are not parameters of this site's model")
    missing = sorted(set(read or ()) - set(arrays))
    if missing:
        raise ValueError(f"the site's model reads {missing[:3]}, which the message does not carry")
    with torch.no_grad():
        for name, tensor in from_record(arrays).items():
            target = parameters[name]
            if tensor.shape == target.shape:
                target.copy_(tensor)
            elif read is not None and name in read:
                target.copy_(read[name].put(torch.zeros_like(target), tensor))
            else:
                raise ValueError(
                    f"array {name!r} has shape {tuple(tensor.shape)}; the model's is {tuple(target.shape)}"
                )
