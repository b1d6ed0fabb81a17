"""Flower's own strategies, reused as they are: each registered under its name with the knobs it takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from flwr.serverapp.strategy import (
    Bulyan,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
    Strategy,
)

from hydrafl.strategies.registry import StrategyConfig, register
from hydrafl.validation import check

if TYPE_CHECKING:
    from hydrafl.config import RunConfig


@register("fedavg")
@dataclass(frozen=True, kw_only=True)
class FedAvgConfig(StrategyConfig):
    """FedAvg: the sample-weighted mean of the sites' weights (McMahan et al., 2017)."""

    secure_sum: ClassVar[bool] = True

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return FedAvg(**common)


@register("fedavgm")
@dataclass(frozen=True, kw_only=True)
class FedAvgMConfig(StrategyConfig):
    """FedAvgM: FedAvg with server momentum (Hsu et al., 2019)."""

    secure_sum: ClassVar[bool] = True

    server_momentum: float = 0.9
    """FedAvgM server momentum."""

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return FedAvgM(server_momentum=self.server_momentum, **common)


@dataclass(frozen=True, kw_only=True)
class ServerOptConfig(StrategyConfig):
    """Adaptive server optimizers (Reddi et al., 2021); the sites' learning rate is the run's `lr`."""

    optimizer: ClassVar[type[FedAdam | FedYogi | FedAdagrad]]
    secure_sum: ClassVar[bool] = True
    server_lr: float = 0.03
    """Server learning rate (eta) of FedAdam, FedYogi and FedAdagrad."""

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return self.optimizer(eta=self.server_lr, eta_l=run.lr, **common)


@register("fedadam")
@dataclass(frozen=True, kw_only=True)
class FedAdamConfig(ServerOptConfig):
    """FedAdam: Adam on the server over the mean update."""

    optimizer = FedAdam


@register("fedyogi")
@dataclass(frozen=True, kw_only=True)
class FedYogiConfig(ServerOptConfig):
    """FedYogi: Yogi on the server over the mean update."""

    optimizer = FedYogi


@register("fedadagrad")
@dataclass(frozen=True, kw_only=True)
class FedAdagradConfig(ServerOptConfig):
    """FedAdagrad: Adagrad on the server over the mean update."""

    optimizer = FedAdagrad


@register("fedmedian")
@dataclass(frozen=True, kw_only=True)
class FedMedianConfig(StrategyConfig):
    """FedMedian: the coordinate-wise median of the sites' weights (Yin et al., 2018)."""

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return FedMedian(**common)


@register("fedtrimmedavg")
@dataclass(frozen=True, kw_only=True)
class FedTrimmedAvgConfig(StrategyConfig):
    """FedTrimmedAvg: the coordinate-wise trimmed mean (Yin et al., 2018)."""

    trimmed_beta: float = 0.2
    """FedTrimmedAvg: fraction cut at each end."""

    def __post_init__(self) -> None:
        check(0 <= self.trimmed_beta < 0.5, "trimmed-beta", self.trimmed_beta, "0 <= beta < 0.5")

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return FedTrimmedAvg(beta=self.trimmed_beta, **common)


@register("krum")
@dataclass(frozen=True, kw_only=True)
class KrumConfig(StrategyConfig):
    """Krum: the site update closest to its neighbours (Blanchard et al., 2017)."""

    krum_malicious: int = 0
    """Krum: number of sites assumed malicious."""

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return Krum(num_malicious_nodes=self.krum_malicious, **common)


@register("multikrum")
@dataclass(frozen=True, kw_only=True)
class MultiKrumConfig(StrategyConfig):
    """Multi-Krum: the mean of the m site updates with the best Krum scores (Blanchard et al., 2017)."""

    krum_malicious: int = 0
    """Number of sites assumed malicious (f)."""
    krum_selected: int = 1
    """Multi-Krum: how many of the best-scored updates are averaged (m; 1 is Krum)."""

    def __post_init__(self) -> None:
        check(self.krum_malicious >= 0, "krum-malicious", self.krum_malicious, "an integer >= 0")
        check(self.krum_selected >= 1, "krum-selected", self.krum_selected, "an integer >= 1")

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        return MultiKrum(
            num_malicious_nodes=self.krum_malicious,
            num_nodes_to_select=self.krum_selected,
            **common,
        )


@register("bulyan")
@dataclass(frozen=True, kw_only=True)
class BulyanConfig(StrategyConfig):
    """Bulyan: Multi-Krum selects, then a coordinate-wise trimmed mean around the median (El Mhamdi et al.,
    2018); it needs at least 4f + 3 sites."""

    krum_malicious: int = 0
    """Number of sites assumed malicious (f)."""

    def __post_init__(self) -> None:
        check(self.krum_malicious >= 0, "krum-malicious", self.krum_malicious, "an integer >= 0")

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        check(
            run.sites >= 4 * self.krum_malicious + 3,
            "krum-malicious",
            self.krum_malicious,
            f"at most (sites - 3) / 4 = {(run.sites - 3) // 4} for Bulyan over {run.sites} sites",
        )
        return Bulyan(num_malicious_nodes=self.krum_malicious, **common)
