"""Importance scores a site computes on its own data: one per layer (`layer_importance`) and one per head or
KV group (`head_importance`). They are the few floats the coordinator ranks layers and picks heads from
(`subnet.planning`); the site's data never leaves it. Under central DP or secure aggregation a site reports
`weight_magnitude` instead, which reads no data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import torch
from torch import nn

from hydrafl.losses import LossFn, classification_loss
from hydrafl.subnet.apply import is_federated
from hydrafl.subnet.architecture import find_architecture
from hydrafl.subnet.families import EXPERT_ROUTER


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
        if n < len(y):
            x = {k: v[:n] for k, v in x.items()} if isinstance(x, Mapping) else x[:n]
            y = y[:n]
        yield x, y
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
        for p, flag in zip(params, flags, strict=True):
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
        if arch.layer_of(n) is not None and (over == "all" or is_federated(p))
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
                    grads = torch.autograd.grad(
                        loss_fn(model, _one(x, i), y[i : i + 1]), params, allow_unused=True
                    )
                    for j, g in enumerate(grads):
                        if g is not None:
                            acc[j] += g.double().pow(2).sum()
            else:
                grads = torch.autograd.grad(loss_fn(model, x, y), params, allow_unused=True)
                for j, (g, p) in enumerate(zip(grads, params, strict=True)):
                    if g is not None:
                        acc[j] += len(y) * (g.double() * p.detach().double()).sum()
            total += len(y)
    if total == 0:
        raise ValueError("no samples to score on")
    sums = [torch.zeros((), dtype=torch.float64) for _ in range(arch.num_layers)]
    for (layer, _), a in zip(named, acc, strict=True):
        sums[layer] += a
    # fisher: trace of the layer's empirical Fisher; taylor: |theta . mean gradient| of the layer.
    return [float(s) / total if method == "fisher" else abs(float(s)) / total for s in sums]


def weight_magnitude(model: nn.Module) -> tuple[list[float], list[list[float]]]:
    """Layer and head scores from the model's weights alone: each layer's squared parameter norm, and per head
    (KV group) the squared norm of the output projection's columns it feeds. Data-dependent scores from one
    site would be a release outside the DP budget, and a per-site signal that secure aggregation promises the
    coordinator never sees; these are a function of the global model, which every site already holds."""
    arch = find_architecture(model)
    layers = [0.0] * arch.num_layers
    for name, parameter in model.named_parameters():
        layer = arch.layer_of(name)
        if layer is not None:
            layers[layer] += float(parameter.detach().double().pow(2).sum())
    heads = []
    for ref in arch.layers:
        weight = model.get_submodule(ref.o).weight.detach().double()  # (hidden, heads x head_dim)
        heads.append(weight.unflatten(1, (arch.num_groups, -1)).pow(2).sum((0, 2)).tolist())
    return layers, heads


class _HeadGates:
    """Forward pre-hook on o: multiplies each sample's head group g by a gate xi[b, g] = 1 that requires grad,
    so dL/dxi[b, g] = A_g(x_b)^T dL/dA_g(x_b) (Michel et al.) per sample, in one backward pass."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.gates: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        gate = torch.ones(
            x.shape[0], self.num_groups, dtype=x.dtype, device=x.device, requires_grad=True
        )
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
        hooks = [
            model.get_submodule(ref.o).register_forward_pre_hook(g)
            for ref, g in zip(arch.layers, gates, strict=True)
        ]
        try:
            with _scoring_mode(model, []):
                for x, y in _samples(batches, max_samples):
                    for g in gates:
                        g.gates.clear()
                    loss = loss_fn(model, x, y) * len(y)
                    used = [(i, g.gates[-1]) for i, g in enumerate(gates) if g.gates]
                    grads = torch.autograd.grad(loss, [gate for _, gate in used], allow_unused=True)
                    for (i, _), grad in zip(used, grads, strict=True):
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
                    raise RuntimeError(
                        f"layer {index} attention returned no weights even in eager mode"
                    )
                captured[index] = weights.detach()

            return hook

        hooks = [
            model.get_submodule(ref.attention).register_forward_hook(capture(ref.index))
            for ref in arch.layers
        ]
        try:
            with _scoring_mode(model, []), eager_attention(model), torch.no_grad():
                for x, y in _samples(batches, max_samples):
                    captured.clear()
                    loss_fn(model, x, y)
                    for i, w in captured.items():  # w: [batch, heads, queries, keys]
                        per_head = (
                            w.double().amax(-1).mean(-1).sum(0)
                        )  # [heads], summed over the batch
                        acc[i] += per_head.view(arch.num_groups, arch.group_size).mean(-1)
                    total += len(y)
        finally:
            for h in hooks:
                h.remove()
    if total == 0:
        raise ValueError("no samples to score on")
    return (acc / total).tolist()


def expert_routing(
    model: nn.Module,
    batches: Iterable[tuple[Any, torch.Tensor]],
    *,
    ignore_index: int = -100,
    max_samples: int | None = None,
) -> tuple[list[list[float]], list[list[list[float]]]]:
    """Per layer of a mixture-of-experts model, from its routers' top-k choices on the site's tokens:
    routed[l][e], the share of tokens sent to expert e, and coactivation[l][i][j], the share sent to both i
    and j (its diagonal is `routed`). Tokens whose target is `ignore_index` (padding) are not counted; a
    target of another shape than the tokens (a class label) counts every position."""
    arch = find_architecture(model)
    if not arch.num_experts:
        raise ValueError(f"{type(model).__name__} has no experts to score")
    chosen: dict[int, torch.Tensor] = {}

    def capture(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            chosen[index] = output[2].detach()  # [tokens, k] expert indices

        return hook

    routers = [model.get_submodule(f"{ref.name}.{EXPERT_ROUTER}") for ref in arch.layers]
    hooks = [r.register_forward_hook(capture(i)) for i, r in enumerate(routers)]
    co = torch.zeros(arch.num_layers, arch.num_experts, arch.num_experts, dtype=torch.float64)
    tokens = 0
    try:
        with _scoring_mode(model, []), torch.no_grad():
            for x, y in _samples(batches, max_samples):
                chosen.clear()
                model(x)
                valid = (y != ignore_index).reshape(-1) if y.shape == x.shape else None
                for layer, index in chosen.items():
                    hot = torch.zeros(index.shape[0], arch.num_experts, dtype=torch.float64)
                    hot.scatter_(1, index.long(), 1.0)  # [tokens, experts]
                    hot = hot if valid is None else hot[valid]
                    co[layer] += hot.T @ hot
                tokens += int(valid.sum()) if valid is not None else x.numel()
    finally:
        for h in hooks:
            h.remove()
    if tokens == 0:
        raise ValueError("no tokens to score on")
    co /= tokens
    return [row.diagonal().tolist() for row in co], co.tolist()


def router_magnitude(model: nn.Module) -> list[list[float]]:
    """Per layer, per expert: the squared norm of its router row, the private run's expert score (a function
    of the global model alone, as `weight_magnitude`)."""
    arch = find_architecture(model)
    return [
        model.get_submodule(f"{ref.name}.{EXPERT_ROUTER}")
        .weight.detach()
        .double()
        .pow(2)
        .sum(1)
        .tolist()
        for ref in arch.layers
    ]


__all__ = [
    "eager_attention",
    "expert_routing",
    "head_importance",
    "layer_importance",
    "router_magnitude",
]
