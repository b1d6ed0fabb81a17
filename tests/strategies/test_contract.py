"""The one strategy contract: capabilities checked at registration, every registered strategy consistent,
defaults written once, site halves found by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from hydrafl.strategies import registry
from hydrafl.strategies.registry import StrategyConfig, check_capabilities, register


def test_every_registered_strategy_passes_the_capability_checks():
    for name in registry.strategy_names():
        check_capabilities(name, registry.config_class(name))


def test_a_strategy_that_probes_curvature_without_an_outer_optimizer_is_refused_at_registration():
    @dataclass(frozen=True, kw_only=True)
    class Probing(StrategyConfig):
        probes_curvature: ClassVar[bool] = True

        def build(self, run: Any, **common: Any) -> Any:
            return None

    with pytest.raises(TypeError, match="probes curvature.*outer_lr"):
        register("probing-without-outer")(Probing)
    assert "probing-without-outer" not in registry._REGISTRY


def test_a_config_without_build_is_refused():
    @dataclass(frozen=True, kw_only=True)
    class Empty(StrategyConfig):
        pass

    with pytest.raises(TypeError, match="defines no build"):
        register("empty")(Empty)


def test_site_halves_are_found_by_the_strategy_name_alone():
    expected = {
        "fedprox": "FedProxSite",
        "scaffold": "ScaffoldSite",
        "fednova": "FedNovaSite",
        "hydra": "SubnetSite",
        "fjord": "SubnetSite",
        "hetlora": "LoraSite",
        "fedit": "LoraSite",
    }
    for name, half in expected.items():
        assert registry.site_half(name).__name__ == half  # type: ignore[union-attr]
    assert registry.site_half("fedavg") is None and registry.site_half("") is None
