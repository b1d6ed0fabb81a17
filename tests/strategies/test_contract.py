"""The one strategy contract: capabilities checked at registration, every registered strategy consistent,
defaults written once, site halves found by name."""

from __future__ import annotations

import os
import subprocess
import sys
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


def test_an_installed_package_adds_a_site_half_that_the_site_imports_alone(tmp_path):
    """An outside package declares `name` (its strategy module) and `name.site` (its site half) in the
    `hydrafl.strategies` entry-point group; a site finds the half by the run's strategy name and imports only
    the half's module."""
    (tmp_path / "my_strategy.py").write_text(
        "raise ImportError('a site must not import the coordinator half')\n"
    )
    (tmp_path / "my_site.py").write_text(
        "from hydrafl.strategies.registry import register_site\n"
        "from hydrafl.strategies.site import SiteHalf\n\n\n"
        '@register_site("my-fedavg")\n'
        "class MySite(SiteHalf):\n"
        '    reply_arrays = ("my.extra",)\n'
    )
    info = tmp_path / "my_strategy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-strategy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[hydrafl.strategies]\nmy-fedavg = my_strategy\nmy-fedavg.site = my_site\n"
    )
    probe = (
        "import sys\n"
        "from hydrafl.strategies.registry import reply_arrays, site_half\n"
        "print(site_half('my-fedavg').__name__, *reply_arrays('my-fedavg'), 'my_strategy' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["MySite", "my.extra", "False"]
