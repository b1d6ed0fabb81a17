"""What a site measures of its model for the coordinator: how its tensors split over attention heads and where
its tokens route among experts (the Hydra-net planning round), and its loss curvature (the DiLoCo stability
check)."""

from __future__ import annotations

from typing import Any

import torch

from hydrafl import protocol
from hydrafl.losses import LossFn, classification_loss
from hydrafl.models import federated_state
from hydrafl.subnet.architecture import find_architecture, head_axis_of
from hydrafl.subnet.scoring import expert_routing, router_magnitude


def slice_layout(model: torch.nn.Module) -> dict[str, list[str] | list[int]]:
    """How each federated tensor splits over heads, as flat lists for a ConfigRecord: per name its layer
    (-1 outside the layers), head axis (-1 when every element serves every head) and the run of indices
    along that axis one head group owns (query heads of a KV group for q and o, one KV head for k and v).
    With it the coordinator rebuilds any spec's slices (`subnet.slices.layout_slices`) without the model."""
    arch = find_architecture(model)
    names = list(federated_state(model))
    layers, axes, units = [], [], []
    for name in names:
        layer, role, axis = head_axis_of(arch, name)
        layers.append(-1 if layer is None else layer)
        axes.append(-1 if axis is None else axis)
        units.append(arch.head_dim * (1 if role in ("k", "v") else arch.group_size))
    return {
        protocol.LAYOUT_NAMES: names,
        protocol.LAYOUT_LAYERS: layers,
        protocol.LAYOUT_AXES: axes,
        protocol.LAYOUT_UNITS: units,
    }


def expert_scores(
    model: torch.nn.Module, batches: list[tuple[Any, torch.Tensor]], *, private: bool
) -> dict[str, float]:
    """A mixture-of-experts model's expert scores (none without experts): how often the site's tokens route
    to each expert (`expert-L-E`) and to each pair together (`coact-L-I-J`); a private run reports the router
    rows' squared norms, which read no data, and no co-activation."""
    if not find_architecture(model).num_experts:
        return {}
    co: list[list[list[float]]] = []
    if private:
        routed = router_magnitude(model)
    else:
        routed, co = expert_routing(model, batches)
    scores = {
        f"{protocol.EXPERT_PREFIX}{layer}-{e}": value
        for layer, row in enumerate(routed)
        for e, value in enumerate(row)
    }
    for layer, matrix in enumerate(co):
        for i, row in enumerate(matrix):
            for j in range(i + 1, len(row)):
                scores[f"{protocol.COACTIVATION_PREFIX}{layer}-{i}-{j}"] = row[j]
    return scores


def estimate_curvature(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    seed: int,
    iterations: int = 6,
    loss_fn: LossFn = classification_loss,
) -> tuple[float, float]:
    """Top Hessian eigenvalue h of the task's mean loss `loss_fn` (power iteration on Hessian-vector products)
    and the variance over samples of the per-sample curvature u^T H_i u along that direction."""
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]

    def hvp(loss: torch.Tensor, vector: list[torch.Tensor]) -> list[torch.Tensor]:
        grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
        dot = sum((g * u).sum() for g, u in zip(grads, vector, strict=True) if g is not None)
        second = torch.autograd.grad(dot, params, allow_unused=True)
        return [
            torch.zeros_like(p) if h is None else h for p, h in zip(params, second, strict=True)
        ]

    generator = torch.Generator().manual_seed(seed)
    direction = [torch.randn(p.shape, generator=generator) for p in params]
    for _ in range(iterations):
        norm = torch.sqrt(sum((u**2).sum() for u in direction))
        direction = [u / norm for u in direction]
        product = hvp(loss_fn(model, x, y), direction)
        direction = product
    norm = torch.sqrt(sum((u**2).sum() for u in direction))
    direction = [u / norm for u in direction]
    per_sample = []
    for i in range(min(len(x), 8)):
        product = hvp(loss_fn(model, x[i : i + 1], y[i : i + 1]), direction)
        per_sample.append(
            float(sum((p * u).sum() for p, u in zip(product, direction, strict=True)))
        )
    samples = torch.tensor(per_sample, dtype=torch.float64)
    return float(samples.mean().abs()), float(samples.var())
