"""A strategy plugs in from its own module: it registers itself with its knobs, and `hydrafl simulate`'s code
path (flat keys -> SimulationConfig -> compare_strategies) runs it without any other file knowing its name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from flwr.app import ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAvg
from helpers import SMALL_RUN

from hydrafl.arrays import from_record, to_record
from hydrafl.config import ConfigError, RunConfig
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation_config import build_simulation_config
from hydrafl.strategies import StrategyConfig, WeightedDeltaAccumulator, register
from hydrafl.strategies.registry import describe


class DampedAverage(FedAvg):
    """The sample-weighted mean delta, scaled by `damping`: 1 is FedAvg, 0 never moves the model."""

    consumes_deltas = True

    def __init__(self, *, damping: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.damping = damping
        self.start: ArrayRecord | None = None

    def configure_train(self, server_round, arrays, config, grid):
        self.start = arrays
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        accumulator = WeightedDeltaAccumulator(self.weighted_by_key)
        accumulator.add_all(replies)
        mean = accumulator.mean()
        weights = {
            name: w - self.damping * mean[name] for name, w in from_record(self.start).items()
        }
        return to_record(weights), self.train_metrics_aggr_fn(
            accumulator.metric_records, self.weighted_by_key
        )


@register("damped-average")
@dataclass(frozen=True, kw_only=True)
class DampedAverageConfig(StrategyConfig):
    """Damped average: the mean delta times a damping factor."""

    damping: float = 0.5
    """How much of the mean delta the global model takes."""

    def build(self, run: RunConfig, **common: Any) -> DampedAverage:
        return DampedAverage(damping=self.damping, **common)


RUN = {
    key: value
    for key, value in SMALL_RUN.replace(rounds=2, lr=2e-3).to_flower().items()
    if key != "strategy"
}
"""The small run as the flat keys of a config file (the strategies come with each test)."""


def _losses(tmp_path, **values: Any) -> dict[str, list[float]]:
    config = build_simulation_config({**RUN, "out": str(tmp_path), **values})
    compare_strategies(config, show_progress=False)
    results = json.loads((tmp_path / "results.json").read_text())["strategies"]
    return {
        name: [record["loss"] for record in result["rounds"]] for name, result in results.items()
    }


@pytest.mark.slow
def test_a_strategy_defined_here_runs_through_simulate_with_its_own_knob(tmp_path):
    losses = _losses(tmp_path / "one", strategies="damped-average,fedavg", damping=1.0)
    assert losses["damped-average"] == pytest.approx(
        losses["fedavg"], rel=1e-5
    )  # damping 1 is FedAvg
    frozen = _losses(tmp_path / "zero", strategies="damped-average", damping=0.0)["damped-average"]
    assert frozen == pytest.approx([frozen[0]] * 3, rel=1e-6)  # damping 0 never moves the model
    assert losses["fedavg"][-1] < frozen[0]


def test_its_knob_is_checked_by_name_and_listed_with_its_doc():
    with pytest.raises(
        ConfigError, match="'damping' in options; it is a knob of damped-average, not of fedavg"
    ):
        build_simulation_config({**RUN, "strategies": "fedavg", "damping": 0.2})
    with pytest.raises(ConfigError, match="key 'damping' in options must be float"):
        build_simulation_config({**RUN, "strategies": "damped-average", "damping": "high"})
    listed = {name: knobs for name, _, knobs in describe()}
    assert listed["damped-average"] == [
        ("damping", "0.5", "How much of the mean delta the global model takes.")
    ]
    assert (
        RunConfig.from_flower(
            RunConfig.build(strategy="damped-average", damping=0.25).to_flower()
        ).options.damping
        == 0.25
    )


def _readme_strategy_module(folder: Path) -> None:
    """README's "Adding a strategy" block, verbatim, as `folder/my_strategy.py` (with the MyFedAvg it builds)."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    example = (
        readme.split("### Adding a strategy", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    )
    assert "from __future__" not in example
    strategy = (
        "class MyFedAvg(FedAvg):\n    def __init__(self, *, damping, **common):\n        super().__init__(**common)\n"
        "        self.damping = damping\n"
    )
    (folder / "my_strategy.py").write_text(
        example.replace("\n@register", f"\n{strategy}\n\n@register", 1)
    )


def _python(folder: Path, code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(folder)},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_an_installed_package_adds_a_strategy_through_the_entry_point_group(tmp_path):
    _readme_strategy_module(tmp_path)
    info = tmp_path / "my_strategy-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-strategy\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[hydrafl.strategies]\nmy-fedavg = my_strategy\n")
    listed = _python(
        tmp_path, "from hydrafl.strategies.registry import strategy_names\nprint(*strategy_names())"
    )
    assert (
        "my-fedavg" in listed.split() and "fedavg" in listed.split()
    )  # beside the built-ins, never imported by hand


def test_readmes_strategy_example_works_as_written_without_postponed_annotations(tmp_path):
    """README's "Adding a strategy" block, verbatim, in a module without `from __future__ import annotations` (its
    knob annotated with the type `float`, not the string): its flag parses, a config file's int is taken as a float,
    and it builds."""
    _readme_strategy_module(tmp_path)
    probe = (
        "import my_strategy\n"
        "from hydrafl.config_keys import key_type\n"
        "from hydrafl.config import RunConfig\n"
        "from hydrafl.strategies import build_strategy\n"
        "run = RunConfig.from_flower({'strategy': 'my-fedavg', 'damping': 1}, source='a config file')\n"
        "print(key_type('damping'), type(run.options.damping).__name__, build_strategy(run).damping)\n"
    )
    assert _python(tmp_path, probe).split() == ["float", "float", "1.0"]
