"""What `hydrafl simulate` adds to a run's configuration: the strategies compared, the backend, the output
folder, the simulated attack and site policy; and the one builder from flat keys (TOML merged with flags)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydrafl.config import (
    ATTACKS,
    BACKENDS,
    COMPARISON_LORA_RANK,
    DEFAULT_STRATEGIES,
    RUN_KEYS,
    SIMULATION_KEYS,
    RunConfig,
    checked_config_class,
    coerce,
    unknown_key,
)
from hydrafl.run_folders import new_run_folder, newest_run
from hydrafl.strategies.registry import UnknownStrategy, config_class, knob_names, refuse_unknown
from hydrafl.tracking import TrackTarget
from hydrafl.validation import ConfigError
from hydrafl.validation import check as _check


@dataclass(frozen=True, kw_only=True, slots=True)
class SimulationConfig:
    """`hydrafl simulate`: the same federation run once per strategy."""

    run: RunConfig = field(default_factory=RunConfig)
    """The run-wide settings; its strategy's knobs apply to every compared strategy that shares them."""
    strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    """Comma-separated strategy names."""
    knobs: dict[str, Any] = field(default_factory=dict)
    """Strategy knobs (snake_case); each applies to every compared strategy that has it."""
    backend: str = "inprocess"
    """inprocess (default) or ray (needs hydrafl[ray])."""
    out: str = ""
    """Output folder; empty: a new folder under hydrafl-runs/ named by the start time, linked as
    hydrafl-runs/latest (with --resume: the newest run there). A folder holding an earlier run is refused unless
    the run resumes it."""
    attack: str = ""
    """Simulated attack by a fraction of the sites (`attackers`): signflip, scale, gaussian, alie or ipm; empty:
    every site is honest (in-process backend only)."""
    attackers: float = 0.0
    """The fraction of the sites that attack (round(fraction x sites), a seeded choice fixed for the run)."""
    site_policy: str = ""
    """A site policy TOML (`hydrafl site --policy`) every simulated site applies to its replies: clipping, local
    DP noise, max-epsilon."""
    workers: int = 0
    """Worker processes the inprocess backend runs sites in, in parallel; 0 = one per core; 1 = every site in
    this process, one after another. The results are the same, bit for bit, whatever the number."""
    export: bool = False
    """Write each strategy's final model to OUT/STRATEGY/model in the form a hospital loads without hydrafl: a
    Hugging Face `save_pretrained` folder, a PEFT adapter beside its base, or safetensors with its architecture."""
    stats: bool = False
    """Before training, each simulated site reports its cohort statistics (the `stats` job, released by
    --site-policy) into OUT/stats: stats.md, stats.json and PNGs."""
    track: str = ""
    """Follow each strategy's run in TensorBoard (tensorboard:DIR, one folder per run under DIR) or MLflow
    (mlflow:URI, e.g. sqlite:///mlflow.db): per-round metrics, the configuration, the report and plots at the end.
    Needs the tensorboard or mlflow extra."""

    def __post_init__(self) -> None:
        _check(
            len(self.strategies) >= 1, "strategies", self.strategies, "at least one strategy name"
        )
        _check(
            not self.attack or (self.attack in ATTACKS and self.backend == "inprocess"),
            "attack",
            self.attack,
            f"empty, or one of {', '.join(ATTACKS)} on the inprocess backend",
        )
        _check(
            0 <= self.attackers < 1 and bool(self.attack) == (self.attackers > 0),
            "attackers",
            self.attackers,
            "a fraction in (0, 1) with --attack, 0 without",
        )
        _check(
            not (self.run.secagg and self.attack),
            "attack",
            self.attack,
            "empty with --secagg (the simulated attacks forge plain updates, which secure aggregation never sends)",
        )
        _check(self.backend in BACKENDS, "backend", self.backend, ", ".join(BACKENDS))
        if self.track:
            TrackTarget.parse(self.track)
        _check(
            self.run.job == "train",
            "job",
            self.run.job,
            "train in a simulation (--stats reports the statistics before training)",
        )
        _check(
            isinstance(self.workers, int)
            and not isinstance(self.workers, bool)
            and self.workers >= 0,
            "workers",
            self.workers,
            "a whole number >= 0 (0: one per core)",
        )
        _check(
            len(set(self.strategies)) == len(self.strategies),
            "strategies",
            self.strategies,
            "no repeats",
        )
        for strategy in self.strategies:
            checked_config_class(strategy, "--strategies")
        for knob in self.knobs:
            owners = [s for s in self.strategies if knob in knob_names(config_class(s))]
            if not owners:
                raise ConfigError(
                    unknown_key(knob.replace("_", "-"), "options", self.strategies, simulation=True)
                )
        if (
            not self.out
        ):  # once the names are known good: a new folder, or with --resume the newest run's
            object.__setattr__(
                self, "out", newest_run(self.strategies) if self.run.resume else new_run_folder()
            )
        for strategy in self.strategies:  # fail before the first strategy runs, not after it
            self.run_config(strategy)

    def run_config(self, strategy: str) -> RunConfig:
        """The run of one strategy. A LoRA-only strategy compared in a run without LoRA (say flora next to
        hydra and fedavg on the full model) trains adapters of rank `COMPARISON_LORA_RANK`; every other
        strategy keeps the run as configured."""
        options_class = config_class(strategy)
        lora_rank = (
            COMPARISON_LORA_RANK
            if options_class.federates_lora and not self.run.lora_rank
            else self.run.lora_rank
        )
        run_knobs = dataclasses.asdict(
            self.run.options
        )  # the run's own strategy's knobs, where they are shared
        knobs = {
            name: value
            for name, value in {**run_knobs, **self.knobs}.items()
            if name in knob_names(options_class)
        }
        return dataclasses.replace(
            self.run,
            strategy=strategy,
            options=options_class(**knobs),
            run_dir=str(Path(self.out) / strategy),
            lora_rank=lora_rank,
        )


def build_simulation_config(values: dict[str, Any], *, source: str = "options") -> SimulationConfig:
    """Build a config from flat key/values (TOML file and CLI flags merged); unknown keys are an error."""
    run_values: dict[str, Any] = {}
    sim_values: dict[str, Any] = {}
    knob_values: dict[str, Any] = {}
    for key, value in values.items():
        name = key.replace("-", "_")
        if name in RUN_KEYS and name != "strategy":
            run_values[name] = coerce(RunConfig, name, key, value, source)
        elif name in SIMULATION_KEYS:
            sim_values[name] = value
        else:
            knob_values[name] = (key, value)
    if isinstance(sim_values.get("strategies"), str):
        sim_values["strategies"] = tuple(
            s.strip() for s in sim_values["strategies"].split(",") if s.strip()
        )
    elif "strategies" in sim_values:
        sim_values["strategies"] = tuple(sim_values["strategies"])
    strategies = sim_values.get("strategies", DEFAULT_STRATEGIES)
    try:  # every name and run-wide value, before the first known name loads the strategies' modules (and torch)
        refuse_unknown(strategies)
        RunConfig(**run_values, strategy="")  # no strategy: the checks of the run-wide values alone
    except UnknownStrategy as error:
        raise ConfigError(f"--strategies: {error}") from None
    for strategy in strategies:
        checked_config_class(strategy, "--strategies")
    knobs = {}
    for name, (key, value) in knob_values.items():
        owners = [s for s in strategies if name in knob_names(config_class(s))]
        if not owners:
            raise ConfigError(unknown_key(key, source, tuple(strategies), simulation=True))
        knobs[name] = coerce(config_class(owners[0]), name, key, value, source)
    try:
        return SimulationConfig(run=RunConfig(**run_values), knobs=knobs, **sim_values)
    except TypeError as error:
        raise ConfigError(f"invalid configuration in {source}: {error}") from error
