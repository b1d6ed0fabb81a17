"""The local trainer a site runs for one round, and its evaluation.

Training goes through the site kernels (`hydrafl.kernels.distributed.train_distributed`): `nproc` processes
under DDP, or the same loop in process for nproc=1, on the global batches of the elastic loader. Batch order
is a pure function of (seed, round, site), never of global RNG state or of nproc, so a resumed run, an
uninterrupted run and a run with more processes train on exactly the same batches; the data hash proves it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from hydrafl.data import TaskSpec
from hydrafl.kernels.distributed import train_distributed
from hydrafl.kernels.local_training import LocalTraining
from hydrafl.kernels.peak_flops import mfu
from hydrafl.losses import LossFn, classification_loss
from hydrafl.models import LoraSpec, build_model
from hydrafl.subnet.apply import apply_spec
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.counts import forward_flops
from hydrafl.subnet.spec import SubnetSpec

__all__ = [
    "SiteTrainResult",
    "build_site_model",
    "evaluate",
    "site_seed",
    "train_flops_per_sample",
    "train_site",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteTrainResult:
    end_state: dict[str, torch.Tensor]
    """The trained values of the start state's tensors, on CPU."""
    loss: float
    """Mean training loss over the local steps."""
    num_examples: int
    """Samples trained on this round (steps x global batch)."""
    data_hash: str
    """SHA-256 over the ordered sample ids of every global batch; the same for any nproc."""
    samples_per_s: float
    mfu: float | None
    """Model FLOPs utilisation; None where the device's peak FLOP/s is unknown (CPU, unlisted GPUs)."""
    restarts: int = 0
    """Times the ranks were restarted this round because one died (the delta is that of the last attempt)."""
    peak_stream_bytes: int = 0
    """With layer streaming: the most bytes of block tensors materialised at once."""


def site_seed(seed: int, site: int) -> int:
    """The data-order seed of `site` in a run seeded `seed`: sites of equal size must not share an order."""
    return seed * 1_000_003 + site


def build_site_model(
    task: TaskSpec,
    model: str,
    seed: int,
    spec: SubnetSpec | None,
    *,
    lora: LoraSpec | None = None,
    frozen: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """A fresh copy of a site's working model for a spawned training process: the same LoRA wrapping, the
    working model's `frozen` tensors (e.g. LoRA bases a FLoRA merge changed, which the start state does not
    carry), restricted to the subnetwork `spec` when given (the process ends with the model, so the spec is
    never removed). Picklable through `functools.partial`."""
    net = build_model(task, model=model, seed=seed, lora=lora)
    if frozen:
        unexpected = net.load_state_dict(frozen, strict=False).unexpected_keys
        if unexpected:
            raise KeyError(f"frozen tensors the rebuilt model lacks: {sorted(unexpected)[:5]}")
    if spec is not None:
        apply_spec(net, spec)
    return net


def train_flops_per_sample(
    model: nn.Module, x: torch.Tensor, spec: SubnetSpec | None = None
) -> float:
    """Training FLOPs of one sample: 3x the forward the model executes (`subnet.counts.forward_flops`; the layers a
    bypassing `spec` skips cost nothing), at the token count the first executed transformer layer sees for one
    row of `x`."""
    layer = min(spec.layers) if spec is not None and spec.bypass else 0
    first = model.get_submodule(find_architecture(model).layers[layer].q)
    tokens: list[int] = []
    hook = first.register_forward_pre_hook(lambda _, args: tokens.append(args[0].shape[-2]))
    try:
        with torch.no_grad():
            model(x[:1].to(next(model.parameters()).device))
    finally:
        hook.remove()
    return 3.0 * forward_flops(model, tokens[0], spec)


def train_site(
    model: nn.Module,
    state: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    config: LocalTraining,
    *,
    rebuild: Callable[[], nn.Module] | None = None,
    device: str | torch.device | None = None,
    loss_fn: LossFn = classification_loss,
    spec: SubnetSpec | None = None,
) -> SiteTrainResult:
    """Train for one round from `state` (the tensors to train and send back, already loaded in `model`).

    nproc=1 trains `model` itself in process (it ends on the device it started on, with the trained weights);
    nproc>1 needs `rebuild`, a picklable builder of the same model (e.g. `functools.partial(build_site_model,
    ...)`), and leaves `model` untouched. `device` defaults to the accelerator when there is one. `loss_fn` is
    the task's training loss (`hydrafl.models.training_loss`), picklable for nproc > 1. `spec`: the subnetwork
    applied to `model` (and by `rebuild`), which its MFU counts.
    """
    # the global batch capped at the data; global batches do not depend on the lanes, only how ranks split them
    config = replace(
        config,
        batch_size=min(config.batch_size, len(x)),
        lanes=config.world_size,
        threads=config.threads or torch.get_num_threads(),  # what this site process was given
    )
    if config.batch_size % config.world_size:
        raise ValueError(
            f"batch size {config.batch_size} does not split evenly over {config.world_size} processes; "
            f"use a batch size that is a multiple of {config.world_size}"
        )
    if config.world_size > 1 and rebuild is None:
        raise ValueError(
            f"{config.world_size} processes need `rebuild`, a picklable builder of the model for each"
        )
    home = next(model.parameters()).device
    try:
        result = train_distributed(
            rebuild if config.world_size > 1 else (lambda: model),  # type: ignore[arg-type]
            state,
            x,
            y,
            config,
            device=device,
            loss_fn=loss_fn,
        )
    finally:
        model.to(home)
    utilisation = None
    if result.device_name:
        flops = train_flops_per_sample(model, x, spec)
        utilisation = mfu(
            result.samples_per_s,
            flops,
            device_name=result.device_name,
            devices=config.world_size,
            bf16=config.bf16,
        )
    return SiteTrainResult(
        end_state=result.end_state,
        loss=result.loss,
        num_examples=result.samples,
        data_hash=result.data_hash,
        samples_per_s=result.samples_per_s,
        mfu=utilisation,
        restarts=result.restarts,
        peak_stream_bytes=result.peak_stream_bytes,
    )


@torch.no_grad()
def evaluate(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 256
) -> tuple[float, float]:
    """Mean cross-entropy and accuracy on (x, y): per sample for a `Classifier`, per valid next-token target
    for a `CausalLM` (whose `evaluation_sums` never builds full logits)."""
    model.eval()
    loss_sum, correct, count = 0.0, 0, 0
    for start in range(0, len(x), batch_size):
        batch_loss, batch_correct, batch_count = model.evaluation_sums(  # type: ignore[operator]
            x[start : start + batch_size], y[start : start + batch_size]
        )
        loss_sum, correct, count = (
            loss_sum + batch_loss,
            correct + batch_correct,
            count + batch_count,
        )
    return loss_sum / max(count, 1), correct / max(count, 1)
