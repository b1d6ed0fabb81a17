"""The strategies a run can name, each registered by its own module together with its knobs.

A strategy module declares a frozen `StrategyConfig` subclass for its knobs (attribute docstrings are their
help) whose `build` makes the Flower strategy, and decorates it with `@register("name")`. The first lookup
of a name no module registered yet imports every module of `hydrafl.strategies`, so a module dropped there
registers itself (a name none of them declares is refused from their sources, before any is imported); a
strategy defined anywhere else registers when its module is imported, or, from an installed package, through
the `hydrafl.strategies` entry-point group. This module imports neither torch nor Flower, so configuration can
be read and checked without loading the strategies' code.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from hydrafl.field_docs import field_docs
from hydrafl.validation import ConfigError

if TYPE_CHECKING:
    from flwr.serverapp.strategy import Strategy

    from hydrafl.config import RunConfig
    from hydrafl.strategies.site import SiteHalf


class UnknownStrategy(ValueError):
    """A run names a strategy no module registered."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StrategyConfig:
    """A strategy's own knobs. Subclasses add fields (with attribute docstrings) and check them in
    `__post_init__`; `build` turns them, with the run-wide settings, into the Flower strategy."""

    federates_lora: ClassVar[bool] = False
    """The strategy federates LoRA adapters only: a run without LoRA cannot use it (a comparison gives it
    `COMPARISON_LORA_RANK`)."""
    lora_bases_travel: ClassVar[bool] = False
    """The frozen base weights of the LoRA modules are global arrays too (the strategy merges into them)."""
    site_proximal_term: ClassVar[bool] = False
    """Sites add a proximal term to their loss (it does not combine with the lm-dual inner optimizer)."""
    probes_curvature: ClassVar[bool] = False
    """Before training, sites' curvature is probed to predict whether the outer optimizer is stable (unless
    `checks_stability` says this run skips it)."""
    slices_transformer: ClassVar[bool] = False
    """Sites train a share of a transformer sized in layers, attention heads, FFN width or LoRA rank
    (`subnet.families`): a model without them (the small CNN) cannot run the strategy."""
    secure_sum: ClassVar[bool] = False
    """The strategy needs only the weighted mean of the sites' updates, so it runs under secure aggregation
    (`secagg`), which hands it the sum alone; strategies that need each site's own update refuse it."""

    def checks_stability(self) -> bool:
        """Whether this run probes the sites' curvature before round 1 (`probes_curvature`)."""
        return self.probes_curvature

    def build(self, run: RunConfig, **common: Any) -> Strategy:
        """The strategy for `run`; `common` are Flower's sampling arguments (fractions, minimum nodes)."""
        raise NotImplementedError

    def refuse_ignored(self, knobs: tuple[str, ...], *, used: bool, why: str) -> None:
        """Refuse, by name, a knob set away from its default where the chosen configuration (`used` False)
        never reads it: a silently ignored setting is a misconfiguration found only in the results."""
        if used:
            return
        for field in dataclasses.fields(self):
            if field.name in knobs and getattr(self, field.name) != field.default:
                flag = field.name.replace("_", "-")
                raise ConfigError(
                    f"invalid --{flag}={getattr(self, field.name)!r}: it is ignored {why}"
                )


C = TypeVar("C", bound=type[StrategyConfig])

_REGISTRY: dict[str, type[StrategyConfig]] = {}


OUTER_OPTIMIZER_KNOBS = ("outer_lr", "outer_momentum", "outer_nesterov")
"""The knobs of an outer optimizer (`diloco.OuterConfig`): what a curvature probe predicts the stability of."""


def check_capabilities(name: str, config: type[StrategyConfig]) -> None:
    """TypeError unless the config's declared capabilities agree with what its type holds: a strategy that
    probes curvature holds an outer optimizer's knobs, one whose LoRA bases travel federates LoRA, and every
    strategy builds."""
    if config.build is StrategyConfig.build:
        raise TypeError(f"strategy {name!r}: {config.__qualname__} defines no build()")
    if config.probes_curvature and not set(OUTER_OPTIMIZER_KNOBS) <= set(knob_names(config)):
        raise TypeError(
            f"strategy {name!r} probes curvature, which predicts an outer optimizer's stability, but "
            f"{config.__qualname__} has no {', '.join(OUTER_OPTIMIZER_KNOBS)} knobs"
        )
    if config.lora_bases_travel and not config.federates_lora:
        raise TypeError(f"strategy {name!r} sends LoRA bases but does not federate LoRA")


def register(name: str) -> Callable[[C], C]:
    """Class decorator: `name` is served by this config class and its `build` (`check_capabilities` first)."""

    def decorate(config: C) -> C:
        check_capabilities(name, config)
        if name in _REGISTRY and _REGISTRY[name] is not config:
            raise ValueError(
                f"strategy {name!r} is registered twice: {_REGISTRY[name].__qualname__} and {config.__qualname__}"
            )
        _REGISTRY[name] = config
        return config

    return decorate


ENTRY_POINT_GROUP = "hydrafl.strategies"
"""Where an installed package declares its strategy modules (`[project.entry-points."hydrafl.strategies"]`,
`name = "package.module"`): each is imported with the built-ins, and registers itself as they do. A site half
in a module of its own is declared as `"name.site" = "package.module_site"`; a site imports only that one."""
SITE_SUFFIX = ".site"

_SITE_REGISTRY: dict[str, type[SiteHalf]] = {}

S = TypeVar("S", bound="type[SiteHalf]")


def register_site(name: str) -> Callable[[S], S]:
    """Class decorator: strategy `name`'s sites train through this `SiteHalf` (`hydrafl.strategies.site`)."""

    def decorate(half: S) -> S:
        if name in _SITE_REGISTRY and _SITE_REGISTRY[name] is not half:
            raise ValueError(
                f"strategy {name!r} has two site halves: {_SITE_REGISTRY[name].__qualname__} and {half.__qualname__}"
            )
        _SITE_REGISTRY[name] = half
        return half

    return decorate


SITE_LINE = re.compile(r'^@register_site\("([^"]+)"\)', re.MULTILINE)


def site_half(name: str) -> type[SiteHalf] | None:
    """Strategy `name`'s site half, importing only the module that declares it (the package's sources are read
    for `@register_site("name")` lines, installed packages' entry points for `name` and `name.site`); None when
    the strategy has none: its sites train plainly."""
    if name and name not in _SITE_REGISTRY:
        for module in _site_modules().get(name, ()):
            importlib.import_module(module)
    return _SITE_REGISTRY.get(name)


def reply_arrays(name: str) -> tuple[str, ...]:
    """The ArrayRecords a train reply of strategy `name` carries beside its delta: what its site half declares."""
    half = site_half(name)
    return half.reply_arrays if half is not None else ()


@cache
def _site_modules() -> dict[str, tuple[str, ...]]:
    """Strategy name -> the modules that may register its site half."""
    package = importlib.import_module("hydrafl.strategies")
    found: dict[str, list[str]] = {}
    for module in pkgutil.iter_modules(package.__path__):
        source = Path(getattr(module.module_finder, "path", "")) / f"{module.name}.py"
        if source.is_file():
            for name in SITE_LINE.findall(source.read_text(encoding="utf-8")):
                found.setdefault(name, []).append(f"{package.__name__}.{module.name}")
    declared = {
        ep.name: ep.value.partition(":")[0]
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    }
    for (
        name,
        module,
    ) in declared.items():  # `name.site` when declared, else the strategy's own module
        if not name.endswith(SITE_SUFFIX) and f"{name}{SITE_SUFFIX}" not in declared:
            found.setdefault(name, []).append(module)
        elif name.endswith(SITE_SUFFIX):
            found.setdefault(name.removesuffix(SITE_SUFFIX), []).append(module)
    return {name: tuple(modules) for name, modules in found.items()}


@cache
def _load_builtins() -> None:
    """Import every module of the strategies package, and every module an installed package declares under
    ENTRY_POINT_GROUP, once, so each registers what it defines."""
    package = importlib.import_module("hydrafl.strategies")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        entry_point.load()


REGISTER_LINE = re.compile(r'^@register\("([^"]+)"\)', re.MULTILINE)


def _declared_names() -> tuple[str, ...] | None:
    """Every name a run may choose, known without importing a strategy's module when possible (so a typo is
    refused without loading torch): the registered names once the modules are loaded, else those the package's
    sources declare and those registered from elsewhere; None when only importing tells (`_scanned_builtins`)."""
    if _load_builtins.cache_info().currsize:
        return tuple(_REGISTRY)
    scanned = _scanned_builtins()
    return (
        None
        if scanned is None
        else (*scanned, *(name for name in _REGISTRY if name not in scanned))
    )


@cache
def _scanned_builtins() -> tuple[str, ...] | None:
    """The names the strategies package's modules register, read from their source (`@register("name")` lines);
    None when an installed package declares strategies too (only importing it tells its names) or a module is
    not a plain source file."""
    if importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        return None
    package = importlib.import_module("hydrafl.strategies")
    names: list[str] = []
    for module in pkgutil.iter_modules(package.__path__):
        source = Path(getattr(module.module_finder, "path", "")) / f"{module.name}.py"
        if module.ispkg or not source.is_file():
            return None
        names.extend(REGISTER_LINE.findall(source.read_text(encoding="utf-8")))
    return tuple(names)


def refuse_unknown(names: Iterable[str]) -> None:
    """UnknownStrategy for the first of `names` that no module declares, before any strategy's module loads."""
    for name in names:
        declared = None if name in _REGISTRY else _declared_names()
        if declared is not None and name not in declared:
            raise UnknownStrategy(f"unknown strategy {name!r}; choose one of {', '.join(declared)}")


def config_class(name: str) -> type[StrategyConfig]:
    """The config class of strategy `name`; UnknownStrategy lists the registered names."""
    refuse_unknown([name])
    if name not in _REGISTRY:
        _load_builtins()
    if name not in _REGISTRY:
        raise UnknownStrategy(
            f"unknown strategy {name!r}; choose one of {', '.join(strategy_names())}"
        )
    return _REGISTRY[name]


def strategy_names() -> tuple[str, ...]:
    _load_builtins()
    return tuple(_REGISTRY)


def mean_strategies() -> list[str]:
    """The strategies whose output is a function of the sites' (weighted) mean alone (`secure_sum`): what secure
    aggregation and central DP can serve."""
    return [name for name in strategy_names() if _REGISTRY[name].secure_sum]


def knob_names(config: type[StrategyConfig]) -> tuple[str, ...]:
    """The config's fields, by their snake_case names."""
    return tuple(field.name for field in dataclasses.fields(config))


def strategies_with(knob: str) -> list[str]:
    """The registered strategies that have the snake_case `knob`."""
    return [name for name in strategy_names() if knob in knob_names(_REGISTRY[name])]


def describe() -> Iterator[tuple[str, str, list[tuple[str, str, str]]]]:
    """Per strategy: its name, the first line of its config class's docstring, and (knob, default, doc)."""
    for name in strategy_names():
        config = _REGISTRY[name]
        docs = field_docs(config)
        knobs = [
            (field.name.replace("_", "-"), repr(field.default), docs.get(field.name, ""))
            for field in dataclasses.fields(config)
        ]
        yield name, (config.__doc__ or "").strip().splitlines()[0], knobs


def build_strategy(run: RunConfig) -> Strategy:
    """The strategy of `run`: each training round samples `run.sites_per_round` sites (all by default) once
    `run.available_sites` are connected, evaluation asks `run.fraction_evaluate` of them; with the run's
    central DP (`dp_clip`, `dp_noise_multiplier`) when it has one."""
    strategy = run.options.build(
        run,
        fraction_train=run.fraction_train,
        fraction_evaluate=run.fraction_evaluate,
        min_train_nodes=run.available_sites,
        min_evaluate_nodes=max(1, int(run.available_sites * run.fraction_evaluate)),
        min_available_nodes=run.available_sites,
    )
    if not run.dp_clip:
        return strategy
    from hydrafl.privacy.central import (
        with_central_dp,
    )  # torch and Flower only for a run that needs them

    return with_central_dp(strategy, run)
