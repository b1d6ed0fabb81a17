"""Strategy names a run can ask for: Flower's built-ins (reused as they are) and hydrafl's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.serverapp.strategy import (
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    Strategy,
)

from hydrafl.config import RunConfig
from hydrafl.strategies.diloco import DiLoCo
from hydrafl.strategies.fedit import FedIT
from hydrafl.strategies.flexlora import FlexLoRA
from hydrafl.strategies.flora import FLoRA
from hydrafl.strategies.hetlora import HetLoRA
from hydrafl.strategies.fedrolex import FedRolex
from hydrafl.strategies.fjord import FjORD
from hydrafl.strategies.heterofl import HeteroFL
from hydrafl.strategies.hydra import Hydra

Builder = Callable[[RunConfig, dict[str, Any]], Strategy]


def _budget(cfg: RunConfig) -> dict[str, Any]:
    """What sizes a site's Hydra-net: its tier (or the untiered fractions), and with the round deadline and
    local steps, its measured step cost against its declared memory and speed."""
    return {
        "untiered": (cfg.hydra_layers, cfg.hydra_heads),
        "timeout_s": cfg.round_timeout_s or None,
        "local_steps": cfg.local_steps,
    }


def _width_baseline(cls: type[HeteroFL]) -> Builder:
    """HeteroFL / FjORD / FedRolex get the budget Hydra gives a site of the same tier (or the untiered one)."""
    return lambda cfg, common: cls(**_budget(cfg), **common)


def _lora_baseline(cls: type[FedIT | FLoRA | HetLoRA | FlexLoRA], **options: Any) -> Builder:
    """FedIT / FLoRA / HetLoRA / FlexLoRA give each site the LoRA rank closest to Hydra's budget for its tier."""
    return lambda cfg, common: cls(
        **_budget(cfg), **{name: getattr(cfg, field) for name, field in options.items()}, **common
    )


_BUILDERS: dict[str, Builder] = {
    "fedavg": lambda cfg, common: FedAvg(**common),
    "fedprox": lambda cfg, common: FedProx(proximal_mu=cfg.fedprox_mu, **common),
    "fedavgm": lambda cfg, common: FedAvgM(server_momentum=cfg.server_momentum, **common),
    "fedadam": lambda cfg, common: FedAdam(eta=cfg.server_lr, eta_l=cfg.lr, **common),
    "fedyogi": lambda cfg, common: FedYogi(eta=cfg.server_lr, eta_l=cfg.lr, **common),
    "fedadagrad": lambda cfg, common: FedAdagrad(eta=cfg.server_lr, eta_l=cfg.lr, **common),
    "fedmedian": lambda cfg, common: FedMedian(**common),
    "fedtrimmedavg": lambda cfg, common: FedTrimmedAvg(beta=cfg.trimmed_beta, **common),
    "krum": lambda cfg, common: Krum(num_malicious_nodes=cfg.krum_malicious, **common),
    "diloco": lambda cfg, common: DiLoCo(
        outer_lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=cfg.outer_nesterov, **common
    ),
    "hydra": lambda cfg, common: Hydra(
        **_budget(cfg),
        rescore_every=cfg.rescore_every,
        bypass=cfg.hydra_bypass,
        lora_products=cfg.hydra_lora == "products",
        freeze_heads=cfg.hydra_head_mode == "freeze",
        **(
            {"outer_lr": cfg.outer_lr, "momentum": cfg.outer_momentum, "nesterov": cfg.outer_nesterov}
            if cfg.outer == "nesterov"
            else {}
        ),
        **common,
    ),
    "heterofl": _width_baseline(HeteroFL),
    "fjord": _width_baseline(FjORD),
    "fedrolex": _width_baseline(FedRolex),
    "fedit": _lora_baseline(FedIT),
    "flora": _lora_baseline(FLoRA, alpha="lora_alpha", seed="seed"),
    "hetlora": _lora_baseline(HetLoRA, prune="hetlora_prune", tail_penalty="hetlora_tail_penalty"),
    "flexlora": _lora_baseline(FlexLoRA),
}

STRATEGIES: tuple[str, ...] = tuple(_BUILDERS)


def build_strategy(cfg: RunConfig) -> Strategy:
    """The strategy `cfg.strategy`, sampling every site each round and needing `cfg.required_sites` replies."""
    if cfg.strategy not in _BUILDERS:
        raise ValueError(f"unknown strategy {cfg.strategy!r}; choose one of {', '.join(STRATEGIES)}")
    common = {
        "fraction_train": 1.0,
        "fraction_evaluate": 1.0,
        "min_train_nodes": cfg.required_sites,
        "min_evaluate_nodes": cfg.required_sites,
        "min_available_nodes": cfg.required_sites,
    }
    return _BUILDERS[cfg.strategy](cfg, common)


def consumes_deltas(strategy: Strategy) -> bool:
    """hydrafl strategies aggregate deltas directly; Flower's built-ins get weights reconstructed."""
    return bool(getattr(strategy, "consumes_deltas", False))
