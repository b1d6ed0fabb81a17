"""`hydrafl simulate`: compare strategies on simulated hospital sites in this process; `hydrafl keys` and
`hydrafl strategies`: what can be configured, read from the configuration's own dataclasses."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperCommand

from hydrafl.cli.common import console, fail, fail_one_line, setup_logging

if TYPE_CHECKING:
    from hydrafl.simulation_config import SimulationConfig

FLAG_SETTINGS = {"allow_extra_args": True, "ignore_unknown_options": True}
"""Configuration keys arrive as extra arguments (`hydrafl.cli.flags`): every key is a flag without a list here."""


class KeysInHelp(TyperCommand):
    """`simulate --help` ends with every strategy name and every key with its default. They come from the
    configuration's dataclasses, read only when the help is shown, so `hydrafl --help` stays light."""

    @property
    def epilog(self) -> str:
        from hydrafl.config_keys import describe_keys
        from hydrafl.strategies.registry import strategy_names

        lines = [
            f"[bold]Strategies[/] (--strategies, comma-separated): {', '.join(strategy_names())}; each one's "
            "knobs: hydrafl strategies NAME.",
            "[bold]Keys[/] (--key value; all of them: hydrafl keys):",
        ]
        for key, default, doc in describe_keys():
            first = re.split(r"(?<!e\.g)\. ", doc)[0].rstrip(".")
            lines.append(f"  --{key} [dim](default {escape(default)})[/]: {escape(first)}.")
        return "\n\n".join(lines)

    @epilog.setter
    def epilog(self, value: str | None) -> None:
        """Click sets the static epilog at construction; this one is computed."""


def simulate(
    ctx: typer.Context,
    config: Annotated[
        Path | None, typer.Option(help="TOML file of configuration keys; flags win over it.")
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Log every round and every site's training.")
    ] = False,
    progress: Annotated[bool, typer.Option(help="Show progress bars.")] = True,
) -> None:
    """Compare strategies on simulated non-IID hospital sites; writes results.json, report.md, PNGs, rounds.tsv.

    Every configuration key is a flag: --strategies fedavg,diloco --sites 6 --rounds 20 --outer-lr 0.5.
    `hydrafl keys` lists the run-wide keys with their defaults, `hydrafl strategies` each strategy's knobs; a
    knob applies to every compared strategy that has it.
    """
    from hydrafl.cli.flags import parse_flags
    from hydrafl.config_keys import key_type
    from hydrafl.configfile import load_toml
    from hydrafl.simulation_config import build_simulation_config
    from hydrafl.validation import ConfigError

    try:  # every key, name and path, before torch and Flower are imported (a typo costs a second, not 20)
        values: dict[str, Any] = {
            **(load_toml(config) if config else {}),
            **parse_flags(ctx.args, key_type),
        }
        _check_paths(values)
        simulation = build_simulation_config(values, source=str(config) if config else "options")
    except ConfigError as error:
        fail_one_line(str(error), 2)
    import flwr.common.logger  # noqa: F401  (Flower sets its logger's level when imported: before ours, not after)

    setup_logging(verbose, quiet_rounds=True)
    newest = simulation.run.resume and "out" not in values
    if newest:
        console.print(
            f"continuing {escape(simulation.out)} (the newest run; --out DIR --resume continues another)"
        )
    try:
        results = _compare(simulation, progress, newest)
    except KeyboardInterrupt:
        _stopped(simulation.out, ctx.args, config)
    from hydrafl.simulation.report import SUMMARY_COLUMNS, dedup_lines, summary_rows

    table = Table(title=f"hydrafl simulate -> {simulation.out}")
    for column in SUMMARY_COLUMNS:
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for row in summary_rows(results):
        table.add_row(*row)
    Console().print(table)
    for line in dedup_lines(results):
        console.print(escape(f"dedup {line[2:].replace('**', '')}"), highlight=False)
    if simulation.export:
        _export(simulation)


def _export(simulation: SimulationConfig) -> None:
    """Each strategy's final model beside its results (`--export`)."""
    from hydrafl.cli.export import describe
    from hydrafl.server.administration import export_run

    for strategy in simulation.strategies:
        run_dir = Path(simulation.out) / strategy
        exported = export_run(run_dir, run_dir / "model")
        print(describe(exported.kind, exported.path))


def _compare(simulation: SimulationConfig, progress: bool, newest: bool) -> dict[str, Any]:
    """`compare_strategies`, its errors as exits: a configuration the run's data or checkpoint refuses 2 (with
    the runs to choose from when --resume picked the newest), a failed round 1."""
    from hydrafl.data import DataError
    from hydrafl.run_folders import describe_run, runs
    from hydrafl.server.aggregation.checkpoint import CheckpointError
    from hydrafl.server.aggregation.driver import RoundFailed
    from hydrafl.simulation.compare import compare_strategies
    from hydrafl.validation import ConfigError

    try:
        return compare_strategies(simulation, show_progress=progress)
    except CheckpointError as error:
        listed = "; ".join(describe_run(folder) for folder in runs()) if newest else ""
        fail(
            escape(
                f"{error}"
                + (f"; give --out DIR --resume with another run: {listed}" if listed else "")
            ),
            2,
        )
    except (ConfigError, DataError) as error:
        fail_one_line(str(error), 2)
    except RoundFailed as error:
        fail(str(error), 1)


def _check_paths(values: dict[str, Any]) -> None:
    """The files a simulation reads exist (their contents are the cohort loader's to check, after the imports)."""
    from hydrafl.validation import ConfigError

    for key in ("data", "site-policy", "out"):
        path = values.get(key, values.get(key.replace("-", "_")))
        if not isinstance(path, str) or not path:
            continue
        if key == "out" and Path(path).is_file():
            raise ConfigError(f"--out {path} is a file; give a folder")
        if key != "out" and not Path(path).exists():
            raise ConfigError(f"--{key} {path}: no such file or folder; check --{key}")


ONE_WORD_FLAGS = ("--resume", "--no-resume")
BOOL_WORDS = ("true", "false", "1", "0", "yes", "no")


def continue_command(args: list[str], config: Path | None, out: str) -> str:
    """The command that continues a stopped run: the same configuration, `--out` its folder, `--resume`."""
    kept, i = [], 0
    while i < len(args):
        token = args[i]
        key = token.partition("=")[0]
        if key == "--out":
            i += 1 if "=" in token else 2
        elif key in ONE_WORD_FLAGS:
            takes_word = (
                "=" not in token and i + 1 < len(args) and args[i + 1].lower() in BOOL_WORDS
            )
            i += 2 if takes_word else 1
        else:
            kept.append(token)
            i += 1
    return shlex.join(
        [
            "hydrafl",
            "simulate",
            *(["--config", str(config)] if config else []),
            *kept,
            "--out",
            out,
            "--resume",
        ]
    )


def _stopped(out: str, args: list[str], config: Path | None) -> NoReturn:
    """After Ctrl-C: where the partial run is and the command that continues it; exit 130, as a shell's."""
    from hydrafl.run_folders import earlier_run

    if earlier_run(Path(out)):
        console.print(
            escape(
                f"stopped: the partial run is in {out}; continue it with: "
                f"{continue_command(args, config, out)}"
            ),
            soft_wrap=True,
        )
    else:
        console.print("stopped before a round ended: nothing to continue")
    raise typer.Exit(130)


def keys() -> None:
    """The run-wide configuration keys (flags of `simulate` and `admin run create`, TOML keys) with defaults."""
    from hydrafl.config_keys import describe_keys

    table = Table(title="run-wide keys (strategy knobs: hydrafl strategies)")
    for column in ("key", "default", "meaning"):
        table.add_column(column)
    for row in describe_keys():
        table.add_row(*map(escape, row))
    Console().print(table)


def strategies(
    names: Annotated[
        list[str] | None, typer.Argument(help="Strategies to show (default: all).")
    ] = None,
) -> None:
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
