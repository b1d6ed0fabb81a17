"""The configuration's keys as the command line sees them: each key's type (to parse `--key value`) and its
default and documentation (`hydrafl keys`)."""

from __future__ import annotations

import dataclasses

from hydrafl.config import DEFAULT_STRATEGIES, RunConfig
from hydrafl.field_docs import field_docs, field_types
from hydrafl.simulation_config import SimulationConfig
from hydrafl.strategies.registry import config_class, strategies_with


def key_type(key: str) -> str | None:
    """The type name (bool, int, float or str) of a run-wide, simulation or strategy key; None if unknown."""
    name = key.replace("-", "_")
    for cls in (SimulationConfig, RunConfig):
        types = field_types(cls)
        if name in types and types[name] in ("bool", "int", "float", "str"):
            return types[name]
    if name == "strategies":
        return "str"
    for strategy in strategies_with(name):
        return field_types(config_class(strategy))[name]
    return None


def describe_keys() -> list[tuple[str, str, str]]:
    """(flag, default, doc) of every run-wide and simulation key, in declaration order."""
    rows = []
    for cls in (SimulationConfig, RunConfig):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            if f.name in ("run", "knobs", "options", "strategy"):
                continue
            default = DEFAULT_STRATEGIES if f.name == "strategies" else f.default
            rows.append(
                (
                    f.name.replace("_", "-"),
                    ",".join(default) if f.name == "strategies" else repr(default),
                    docs.get(f.name, ""),
                )
            )
    return rows
