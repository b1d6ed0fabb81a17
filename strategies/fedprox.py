"""FedProx (Li et al., 2020): Flower's own FedProx at the coordinator, which sends its mu to every site as
"proximal-mu"; the proximal term the sites add is its site half's (`fedprox_site.py`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.serverapp.strategy import FedProx, Strategy

from hydrafl.strategies.registry import StrategyConfig, register
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


@register("fedprox")
@dataclass(frozen=True, kw_only=True)
class FedProxConfig(StrategyConfig):
    """FedProx: FedAvg whose sites add a proximal term mu/2 ||w - w_global||^2 (Li et al., 2020)."""

    site_proximal_term: ClassVar[bool] = True
    secure_sum: ClassVar[bool] = True
    fedprox_mu: float = 0.01
    """FedProx proximal term weight (sent to sites by FedProx itself as "proximal-mu")."""

    def __post_init__(self) -> None:
        check(self.fedprox_mu >= 0, "fedprox-mu", self.fedprox_mu, ">= 0")

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return FedProx(proximal_mu=self.fedprox_mu, **common)
