"""Run configuration: the run-wide settings and the chosen strategy's own knobs, validated once at the edge.

`RunConfig` is everything the ServerApp and ClientApp of one federated run need: the sections of
`hydrafl.config_sections` (data, model, site training, federation, privacy, compression), each checking its own
keys, plus the strategy and its knobs and the checks that span sections. It travels as Flower's flat
`run_config` (str/int/float/bool only, so "" means "not set"), once per run to each site: the run-wide keys and
the strategy's knobs side by side, every key kebab-case. The knobs belong to the strategy's `StrategyConfig`
(`hydrafl.strategies`), so this module knows no strategy by name. `SimulationConfig` adds what `hydrafl
simulate` needs to compare several strategies (`hydrafl.simulation_config`). TOML files use the CLI flag
names. Nothing here imports torch, the cohorts or the kernels.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from hydrafl.catalog import IMAGE_MODELS, MOE_MODEL, NEXT_TOKEN_TASKS, has_images, run_model
from hydrafl.config_sections import (
    SECTIONS,
    CompressionConfig,
    DataConfig,
    FederationConfig,
    ModelConfig,
    PrivacyConfig,
    StatsConfig,
    TrainingConfig,
)
from hydrafl.field_docs import field_types
from hydrafl.strategies.registry import (
    StrategyConfig,
    UnknownStrategy,
    config_class,
    knob_names,
    mean_strategies,
    refuse_unknown,
    strategies_with,
    strategy_names,
)
from hydrafl.validation import ConfigError
from hydrafl.validation import check as _check

log = logging.getLogger(__name__)

BACKENDS = ("inprocess", "ray")
ATTACKS = ("signflip", "scale", "gaussian", "alie", "ipm")
"""The simulated Byzantine attacks (`hydrafl.simulation.attacks`)."""
DEFAULT_STRATEGIES = ("fedavg", "fedprox", "fedadam", "diloco")
COMPARISON_LORA_RANK = 8
"""The rank a LoRA-only strategy runs at in a comparison whose run has no LoRA (`lora_rank` 0)."""
SECAGG_ROUND_TIMEOUT_S = 600.0
"""A secure round's deadline when the run sets none (`RunConfig.round_deadline_s`)."""


@dataclass(frozen=True, kw_only=True)
class RunConfig(
    StatsConfig,
    CompressionConfig,
    PrivacyConfig,
    FederationConfig,
    TrainingConfig,
    ModelConfig,
    DataConfig,
):
    """One federated run of one strategy: every section's keys (`hydrafl.config_sections`; a dataclass lists
    its bases' fields from the last base to the first, so data comes first), the strategy and its knobs."""

    strategy: str = "fedavg"
    """The strategy (`hydrafl strategies` lists them and their knobs); "" in a site's view of the run."""
    options: StrategyConfig | None = None
    """The strategy's knobs; None takes its defaults."""

    def __post_init__(self) -> None:
        if self.strategy:  # "" is a site's view: which strategy runs is the coordinator's concern
            options_class = checked_config_class(self.strategy)
            if self.options is None:
                object.__setattr__(self, "options", options_class())
            _check(
                type(self.options) is options_class,
                "strategy",
                self.strategy,
                f"a strategy whose knobs are {type(self.options).__name__} (got them for another "
                "strategy)",
            )
        for section in SECTIONS:
            section.__post_init__(self)
        self._check_training()
        self._check_privacy()
        self._check_secagg()
        self._check_model()

    def _check_training(self) -> None:
        _check(
            self.inner_optimizer != "lm-dual"
            or (
                self.task not in NEXT_TOKEN_TASKS
                and self.nproc == 1
                and not self._knob_class.site_proximal_term
            ),
            "inner-optimizer",
            self.inner_optimizer,
            "not lm-dual here: it steps a classifier's head in one process, without a proximal term "
            "(a classification task, nproc 1, not FedProx)",
        )
        _check(
            not self.stream_layers or self.model != "cnn",
            "stream-layers",
            self.stream_layers,
            "false with model cnn (layer streaming moves transformer blocks; the CNN has none)",
        )
        _check(
            not self.distill_teacher or (self.task in NEXT_TOKEN_TASKS and not self.data),
            "distill-teacher",
            self.distill_teacher,
            f"empty unless the task is a synthetic next-token task ({', '.join(NEXT_TOKEN_TASKS)})",
        )

    def _check_privacy(self) -> None:
        """DP bounds what the strategy's output reveals only when that output post-processes a noised mean."""
        if self.dp_clip and self.strategy and not self._knob_class.secure_sum:
            _check(
                False,
                "dp-clip",
                self.dp_clip,
                f"0 for strategy {self.strategy!r}: its output is not a post-processing of the noised "
                "mean of the clipped updates, so the accounted epsilon would not bound it (use one of "
                f"{', '.join(mean_strategies())})",
            )
        robust_rule = getattr(self.options, "robust_rule", "mean")
        _check(
            robust_rule == "mean" or not self.dp_clip,
            "robust-rule",
            robust_rule,
            "mean with --dp-clip (central DP calibrates its noise to the clipped mean, not to a median)",
        )

    def _check_secagg(self) -> None:
        _check(
            self.secagg_threshold == 0
            or max(2, self.sites // 2 + 1) <= self.secagg_threshold <= self.sites,
            "secagg-threshold",
            self.secagg_threshold,
            f"0 (a majority) or {max(2, self.sites // 2 + 1)}..{self.sites}: "
            "at or below half the sites, a coordinator that lies can unmask one site's update",
        )
        # secure aggregation hands the coordinator the sites' sum alone: whatever needs one site's update refuses
        _check(
            not self.secagg or not self.strategy or self._knob_class.secure_sum,
            "secagg",
            self.secagg,
            f"off for strategy {self.strategy!r}: it needs each site's own update, not their sum",
        )
        for key, value, off in (
            ("screen-norm", self.screen_norm, 0.0),
            ("screen-cosine", self.screen_cosine, -1.0),
            ("diagnostics", self.diagnostics, False),
            ("robust-rule", getattr(self.options, "robust_rule", "mean"), "mean"),
        ):
            _check(
                not self.secagg or value == off,
                key,
                value,
                f"{off} with --secagg: the coordinator never sees one site's update",
            )
        _check(
            not self.secagg or self.compress == "none",
            "compress",
            self.compress,
            "none with --secagg: masked updates are summed exactly, not decoded one by one",
        )

    def _check_model(self) -> None:
        """An image model needs images; the small CNN has no layers, heads or projections to slice or adapt, so
        the Hydra-net strategies, the LoRA baselines and LoRA itself need the tiny ViT."""
        model, slices = (
            run_model(self.model, task=self.task, data=self.data),
            self._knob_class.slices_transformer,
        )
        _check(
            model not in IMAGE_MODELS or has_images(task=self.task, data=self.data),
            "model",
            self.model,
            f"a model for this task: {' and '.join(IMAGE_MODELS)} need images (an image folder or cohort)",
        )
        wants = f"strategy {self.strategy}" if slices else f"lora-rank {self.lora_rank}"
        _check(
            model != "cnn" or not (slices or self.lora_rank),
            "model",
            self.model,
            f"--model vit with {wants}: it slices or adapts transformer layers, which the small CNN "
            "(the default for an image folder) has not",
        )
        defaults = type(self.options)()
        experts = [
            knob.replace("_", "-")
            for knob in ("expert_select", "hydra_experts")
            if getattr(self.options, knob, None) != getattr(defaults, knob, None)
        ]
        _check(
            not experts or model not in ("tiny", "minilm", *IMAGE_MODELS),
            "model",
            self.model,
            f"{MOE_MODEL} or a local mixture-of-experts checkpoint with {' and '.join(experts)}: "
            f"model {model} has no experts to select",
        )
        _check(
            not self._knob_class.federates_lora or self.lora_rank > 0,
            "lora-rank",
            self.lora_rank,
            f"an integer >= 1: strategy {self.strategy} federates LoRA adapters",
        )

    @classmethod
    def build(cls, **values: Any) -> RunConfig:
        """A run from flat snake_case keys: the run-wide ones and the strategy's knobs side by side. A key
        that is neither is refused, naming it and the strategies that have such a knob."""
        run, knobs = _split(values, str(values.get("strategy", "fedavg")), "arguments")
        try:
            options = config_class(run.get("strategy", "fedavg"))(**knobs)
        except UnknownStrategy as error:
            raise ConfigError(str(error)) from None
        return cls(**run, options=options)

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with some run-wide keys or knobs changed; a new strategy keeps the knobs it shares."""
        flat = {**self.flat(), **changes}
        if "strategy" in changes:
            keep = set(knob_names(config_class(changes["strategy"]))) | set(changes)
            flat = {key: value for key, value in flat.items() if key in RUN_KEYS or key in keep}
        return RunConfig.build(**flat)

    def flat(self) -> dict[str, Any]:
        """Run-wide keys and knobs in one snake_case mapping."""
        run = {name: getattr(self, name) for name in RUN_KEYS}
        return {**run, **(dataclasses.asdict(self.options) if self.options is not None else {})}

    @property
    def _knob_class(self) -> type[StrategyConfig]:
        return type(self.options) if self.options is not None else StrategyConfig

    @property
    def required_sites(self) -> int:
        """Successful replies a training round needs: `--min-sites`, else every sampled site; under `--secagg`
        the protocol's threshold, since the survivors' shares recover the masks of the sites that dropped."""
        if self.min_sites or not self.secagg:
            return self.min_sites or self.sites_per_round
        from hydrafl.secagg.params import SecAggParams

        params = SecAggParams(
            max_weight=self.secagg_max_weight, reconstruction_threshold=self.secagg_threshold
        )
        return params.threshold(self.sites_per_round)

    @property
    def round_deadline_s(self) -> float | None:
        """How long a round waits for replies: `--round-timeout-s`; under `--secagg` without one,
        SECAGG_ROUND_TIMEOUT_S, so a site that vanishes mid-protocol cannot stall the round for ever (the
        survivors recover it while a threshold of them remain). None waits for every site."""
        return self.round_timeout_s or (SECAGG_ROUND_TIMEOUT_S if self.secagg else None)

    def to_flower(self) -> dict[str, bool | int | float | str]:
        """Flower's `run_config` form (flat scalars, kebab-case keys)."""
        return {name.replace("_", "-"): value for name, value in self.flat().items()}

    @classmethod
    def from_flower(
        cls,
        run_config: dict[str, Any],
        *,
        source: str = "the run config",
        other_knobs: bool = False,
    ) -> RunConfig:
        """Inverse of `to_flower`; a key that is neither run-wide nor one of the strategy's knobs is refused.
        With `other_knobs`, other strategies' knobs are dropped with a warning instead: a run stored by an
        older hydrafl, which kept every strategy's knobs in every run, still starts."""
        values = {key.replace("-", "_"): value for key, value in run_config.items()}
        strategy = str(values.get("strategy", "fedavg"))
        try:
            refuse_unknown([strategy])
        except UnknownStrategy as error:
            raise ConfigError(f"--strategy: {error}") from None
        run_wide = {name: value for name, value in values.items() if name in RUN_WIDE_KEYS}
        # the run-wide values first, without a strategy: before its module (and torch) loads, as simulate does
        cls(
            **{
                name: coerce(cls, name, name.replace("_", "-"), value, source)
                for name, value in run_wide.items()
            },
            strategy="",
        )
        if other_knobs:
            own = set(knob_names(checked_config_class(strategy)))
            dropped = sorted(
                k for k in values if k not in RUN_KEYS and k not in own and strategies_with(k)
            )
            if dropped:
                log.warning(
                    "%s: ignoring knobs of other strategies: %s", source, ", ".join(dropped)
                )
            values = {k: v for k, v in values.items() if k not in dropped}
        run, knobs = _split(values, strategy, source)
        options_class = checked_config_class(strategy)
        knobs = {
            name: coerce(options_class, name, name.replace("_", "-"), value, source)
            for name, value in knobs.items()
        }
        return cls(
            **{
                name: coerce(cls, name, name.replace("_", "-"), value, source)
                for name, value in run.items()
            },
            options=options_class(**knobs),
        )

    @staticmethod
    def flower_defaults(strategy: str) -> dict[str, bool | int | float | str]:
        """Each key's default for a run of `strategy`, in `to_flower` form (not a valid run by itself: a
        LoRA-only strategy has no default rank)."""
        run = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.name != "options"}
        knobs = {f.name: f.default for f in dataclasses.fields(checked_config_class(strategy))}
        return {
            name.replace("_", "-"): value
            for name, value in {**run, "strategy": strategy, **knobs}.items()
        }

    @classmethod
    def site_view(cls, config: dict[str, Any]) -> RunConfig:
        """The run as a site reads it from a message's config: the run-wide keys only. The message also
        carries the strategy's knobs and the protocol's keys, which are the coordinator's business."""
        values = {key.replace("-", "_"): value for key, value in config.items()}
        return cls(**{name: values[name] for name in RUN_WIDE_KEYS if name in values}, strategy="")


SIMULATION_KEYS = {
    "strategies",
    "backend",
    "out",
    "attack",
    "attackers",
    "site_policy",
    "workers",
    "export",
    "track",
    "stats",
}
"""`hydrafl.simulation_config.SimulationConfig`'s own keys (valid in a comparison, not in one run)."""
RUN_WIDE_KEYS = tuple(
    f.name for f in dataclasses.fields(RunConfig) if f.name not in ("options", "strategy")
)
"""RunConfig's keys that are the same whichever strategy runs (snake_case)."""
RUN_KEYS = (*RUN_WIDE_KEYS, "strategy")


def checked_config_class(strategy: str, flag: str = "--strategy") -> type[StrategyConfig]:
    try:
        return config_class(strategy)
    except UnknownStrategy as error:
        raise ConfigError(f"{flag}: {error}") from None


def _split(
    values: dict[str, Any], strategy: str, source: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Snake_case `values` as (run-wide keys, the strategy's knobs); anything else names the key."""
    knobs_of_strategy = set(knob_names(checked_config_class(strategy)))
    run, knobs = {}, {}
    for name, value in values.items():
        if name in RUN_KEYS:
            run[name] = value
        elif name in knobs_of_strategy:
            knobs[name] = value
        else:
            raise ConfigError(unknown_key(name.replace("_", "-"), source, (strategy,)))
    return run, knobs


def unknown_key(
    key: str, source: str, strategies: tuple[str, ...], *, simulation: bool = False
) -> str:
    owners = strategies_with(key.replace("-", "_"))
    where = (
        f"it is a knob of {', '.join(owners)}, not of {', '.join(strategies)}"
        if owners
        else f"valid keys: {', '.join(valid_keys(strategies, simulation=simulation))}"
    )
    return f"unknown key {key!r} in {source}; {where}"


def valid_keys(strategies: tuple[str, ...] = (), *, simulation: bool = False) -> list[str]:
    """Run-wide keys (and with `simulation` the comparison's), and the knobs of `strategies` (all if none)."""
    knobs = {k for s in strategies or strategy_names() for k in knob_names(config_class(s))}
    keys = set(RUN_WIDE_KEYS) | knobs | (SIMULATION_KEYS if simulation else {"strategy"})
    return sorted(key.replace("_", "-") for key in keys)


def coerce(cls: type, name: str, key: str, value: Any, source: str) -> Any:
    """Accept an int where a float is expected; reject any other type mismatch with the key named."""
    expected = field_types(cls)[name]
    kind = {"int": int, "float": float, "str": str, "bool": bool}[expected]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConfigError(f"key {key!r} in {source} must be {expected}, got {value!r}")
    return value
