"""What one local step costs a site, measured in the planning round on its own model and a training batch: the
coordinator sizes a Hydra-net (`LayerCost`) or a LoRA baseline's rank (`RankCost`, when the scoring query
asks for it) to the site's declared memory and the round deadline from these numbers."""

from __future__ import annotations

import torch
from flwr.app import ConfigRecord

from hydrafl import protocol
from hydrafl.config import RunConfig
from hydrafl.data import TaskSpec
from hydrafl.models import Classifier, build_model, lora_spec, task_loss
from hydrafl.subnet.measure import measure_layer_cost, measure_rank_cost
from hydrafl.subnet.planning import COST_FIELDS, RANK_COST_FIELDS


def step_costs(
    cfg: RunConfig,
    task: TaskSpec,
    model: Classifier,
    batch: tuple[torch.Tensor, torch.Tensor],
    *,
    speed: float,
    request: ConfigRecord,
) -> dict[str, float]:
    """The scoring reply's cost metrics: `cost.*` (the LayerCost of `model`, layers frozen or bypassed as the
    query says) and, asked for it in a LoRA run, `rank-cost.*` (the RankCost of rank-r adapters on every
    layer). Measured on one training batch, as a training round measures its footprint."""
    x, y = batch
    loss = task_loss(task)
    cost = measure_layer_cost(
        model,
        lambda: loss(model, x, y),
        cfg.inner_optimizer,
        speed=speed,
        bypass=bool(request.get(protocol.SCORE_BYPASS, False)),
    )
    metrics = {f"{protocol.COST_PREFIX}{_key(f)}": getattr(cost, f) for f in COST_FIELDS}
    if cfg.lora_rank and request.get(protocol.SCORE_RANK_COST, False):
        rank_cost = measure_rank_cost(
            lambda r: build_model(task, model=cfg.model, seed=cfg.seed, lora=lora_spec(cfg, r)),
            lambda m: loss(m, x, y),
            cfg.inner_optimizer,
            max_rank=cfg.lora_rank,
            speed=speed,
        )
        metrics |= {
            f"{protocol.RANK_COST_PREFIX}{_key(f)}": getattr(rank_cost, f) for f in RANK_COST_FIELDS
        }
    return metrics


def _key(field: str) -> str:
    return field.replace("_", "-")
