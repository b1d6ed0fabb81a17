"""`hydrafl simulate`: compare strategies on simulated hospital sites in this process; `hydrafl keys` and
`hydrafl strategies`: what can be configured, read from the configuration's own dataclasses."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from hydrafl.cli.common import fail, setup_logging

FLAG_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True}
"""Configuration keys arrive as extra arguments (`hydrafl.cli.flags`): every key is a flag without a list here."""


class KeysInHelp(TyperCommand):
    """`simulate --help` ends with every strategy name and every key with its default. They come from the
    configuration's dataclasses, read only when the help is shown, so `hydrafl --help` stays light."""

    @property
    def epilog(self) -> str:
        from hydrafl.config_keys import describe_keys
        from hydrafl.strategies.registry import strategy_names

        lines = [f"[bold]Strategies[/] (--strategies, comma-separated): {', '.join(strategy_names())}; each one's "
                 "knobs: hydrafl strategies NAME.", "[bold]Keys[/] (--key value; all of them: hydrafl keys):"]
        for key, default, doc in describe_keys():
            first = re.split(r"(?<!e\.g)\. ", doc)[0].rstrip(".")
            lines.append(f"  --{key} [dim](default {escape(default)})[/]: {escape(first)}.")
        return "\n\n".join(lines)

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        """Click sets the static epilog at construction; this one is computed."""


def simulate(
    ctx: typer.Context,
    config: Annotated[Path | None, typer.Option(help="TOML file of configuration keys; flags win over it.")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Log every round and every site's training.")] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Compare strategies on simulated non-IID hospital sites; writes results.json, report.md, PNGs, rounds.tsv.

    Every configuration key is a flag: --strategies fedavg,diloco --sites 6 --rounds 20 --outer-lr 0.5.
    `hydrafl keys` lists the run-wide keys with their defaults, `hydrafl strategies` each strategy's knobs; a
    knob applies to every compared strategy that has it.
    """
    from hydrafl.checkpoint import CheckpointError
    from hydrafl.cli.flags import parse_flags
    from hydrafl.simulation_config import build_simulation_config
    from hydrafl.config_keys import key_type
    from hydrafl.configfile import load_toml
    from hydrafl.data import DataError
    from hydrafl.driver import RoundFailed
    from hydrafl.simulation.compare import compare_strategies
    from hydrafl.simulation.report import SUMMARY_COLUMNS, summary_rows
    from hydrafl.validation import ConfigError

    setup_logging(verbose, quiet_rounds=True)
    try:
        values: dict[str, Any] = {**(load_toml(config) if config else {}), **parse_flags(ctx.args, key_type)}
        simulation = build_simulation_config(values, source=str(config) if config else "options")
        results = compare_strategies(simulation, show_progress=progress)
    except (ConfigError, DataError, CheckpointError) as error:
        fail(str(error), 2)
    except RoundFailed as error:
        fail(str(error), 1)
    table = Table(title=f"hydrafl simulate -> {simulation.out}")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in summary_rows(results):
        table.add_row(*row)
    Console().print(table)


def keys() -> None:
    """The run-wide configuration keys (flags of `simulate` and `admin run create`, TOML keys) with defaults."""
    from hydrafl.config_keys import describe_keys

    table = Table(title="run-wide keys (strategy knobs: hydrafl strategies)")
    for column in ("key", "default", "meaning"):
        table.add_column(column)
    for row in describe_keys():
        table.add_row(*map(escape, row))
    Console().print(table)


def strategies(names: Annotated[list[str] | None, typer.Argument(help="Strategies to show (default: all).")] = None) -> None:
    """The registered strategies and their knobs (flags and TOML keys), with defaults."""
    from hydrafl.strategies.registry import describe

    console = Console()
    for name, summary, knobs in describe():
        if names and name not in names:
            continue
        table = Table(title=escape(f"{name}: {summary}"), title_justify="left")
        for column in ("knob", "default", "meaning"):
            table.add_column(column)
        for row in knobs:
            table.add_row(*map(escape, row))
        console.print(table if knobs else escape(f"{name}: {summary} (no knobs)"))
