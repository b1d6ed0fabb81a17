"""Accuracy by round and by cumulative bytes on the pretrained MiniLM: full-model FedAvg run until it plateaus,
against Hydra over LoRA (FlexLoRA, the best LoRA baseline at equal budgets, as reference), over seeds.

    python -m hydrafl.benchmarks.bytes_curves [--out DIR] [--quick] [--seeds N] [--rounds R] [--work DIR]

The `minilm-full` and `minilm-lora` groups of `hydrafl.benchmarks.heterogeneous` (clinical-text, 3 sites of
tiers small, medium, large, 8 local steps a round, their learning rates), run for more rounds. Bytes are what
the runtime counts (array payloads up + down, all sites), each round's evaluation download included. Hydra runs
its default configuration: the layers outside a site's net run frozen, so every site downloads every layer's
LoRA factors (only `--hydra-bypass` would spare those) and uploads only what it trained; the frozen base
encoder is each site's local copy of the pretrained model and never travels. Full FedAvg sends the whole model.

The plateau is FedAvg's accuracy (mean over seeds) averaged over its last 3 rounds; it has plateaued when that
is within 1 point of the 3 rounds before. Per method: the cumulative bytes (mean over seeds) at the first round
its mean accuracy is within 1 point of the plateau, and FedAvg's bytes to get there over it; its level (mean
accuracy over its last 3 rounds, so one lucky evaluation does not count) and the plateau minus it. Goal: Hydra's
level within 1 point and its first round there with >= 10x fewer bytes; else the gap, and Hydra's accuracy
after a tenth of the bytes FedAvg needed.

Each run keeps its folder under `--work` (default: a temporary folder): a folder already holding a run of the
same configuration with at least the rounds asked for done (finished, or still running, or set to more rounds)
gives its first rounds instead of being run again, so the long runs can be started apart and read as they go.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, progress_columns, verdict
from hydrafl.benchmarks.heterogeneous import (
    GOAL_ACCURACY_POINTS,
    GOAL_BYTES_RATIO,
    GROUPS,
    TIERS,
    per_tier,
    run_config,
)
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation_config import SimulationConfig

NAME = "bytes_curves"
METHODS = (("minilm-full", "fedavg"), ("minilm-lora", "hydra"), ("minilm-lora", "flexlora"))
"""(group of `heterogeneous`, strategy): the reference whose plateau sets the goal, Hydra, then the baseline
shown beside it (`--baseline-seeds` may give it fewer seeds)."""
ROUNDS, QUICK_ROUNDS = 12, 2
PLATEAU_ROUNDS = 3


def method_name(group: str, strategy: str) -> str:
    return f"{strategy} ({'LoRA' if GROUPS[group].lora_rank else 'full model'})"


def simulation(
    group: str, strategy: str, seed: int, quick: bool, rounds: int, work: Path
) -> SimulationConfig:
    scale = GROUPS[group].quick if quick else GROUPS[group].full
    return SimulationConfig(
        run=run_config(GROUPS[group], dataclasses.replace(scale, rounds=rounds), seed),
        strategies=(strategy,),
        out=str(work / f"{group}-{strategy}-seed{seed}"),
    )


def recorded(config: SimulationConfig, rounds: int) -> list[dict[str, Any]] | None:
    """Round 0 to `rounds` of a run of `config` already in its folder (its checkpoint's history), finished or
        still running, resumed or not, and whatever rounds it was set to: a run's first rounds do not depend on how
    many follow. None
        when the folder holds no such run: none, another configuration, or fewer rounds done."""
    (strategy,) = config.strategies
    path = Path(config.out) / strategy / "checkpoint.json"
    if not path.exists():
        return None
    stored = json.loads(path.read_text())
    ignored = (
        "rounds",
        "run-dir",
        "resume",
    )  # how long and where it ran, and whether it was resumed
    wanted = json.loads(json.dumps(config.run_config(strategy).to_flower()))
    same = {k: v for k, v in stored["run_config"].items() if k not in ignored} == {
        k: v for k, v in wanted.items() if k not in ignored
    }
    history = stored["history"]
    return history[: rounds + 1] if same and len(history) > rounds else None


def curve(history: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: accuracy and cumulative bytes (up + down, all sites) after each round (round 0: the initial
    evaluation and its download), and per tier the mean bytes a site moved per training round."""
    cumulative, total = [], 0
    for record in history:
        total += record["bytes_up"] + record["bytes_down"]
        cumulative.append(total)
    rounds = history[1:]
    return {
        "accuracy": [record["accuracy"] for record in history],
        "bytes": cumulative,
        **{
            f"bytes_{way}_per_tier": {
                tier: statistics.mean(per_tier(r[f"bytes_{way}_per_site"])[tier] for r in rounds)
                for tier in TIERS
            }
            for way in ("up", "down")
        },
    }


def run(
    seeds: int, baseline_seeds: int, quick: bool, rounds: int, work: Path
) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {}
    counts = (seeds, seeds, baseline_seeds)
    with Progress(*progress_columns()) as progress:
        task = progress.add_task(NAME, total=sum(counts))
        for (group, strategy), count in zip(METHODS, counts, strict=True):
            for seed in range(count):
                config = simulation(group, strategy, seed, quick, rounds, work)
                progress.update(task, description=f"{strategy} seed {seed}")
                history = (
                    recorded(config, rounds)
                    or json.loads(json.dumps(compare_strategies(config, show_progress=False)))[
                        "strategies"
                    ][strategy]["rounds"]
                )
                runs.setdefault(method_name(group, strategy), []).append(
                    {"seed": seed, **curve(history)}
                )
                progress.advance(task)
    return runs


def mean_curve(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [statistics.mean(values) for values in zip(*(r[key] for r in runs), strict=True)]


def first_within(accuracy: list[float], cumulative: list[float], target: float) -> float | None:
    """Cumulative bytes at the first round whose accuracy reaches `target`; None if none does."""
    return next((b for a, b in zip(accuracy, cumulative, strict=True) if a >= target), None)


def at_bytes(accuracy: list[float], cumulative: list[float], budget: float) -> float | None:
    """Accuracy after the last round whose cumulative bytes fit `budget`; None if none does."""
    fitting = [a for a, b in zip(accuracy, cumulative, strict=True) if b <= budget]
    return fitting[-1] if fitting else None


def analyse(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per method its mean curves and where it stands against the reference's plateau (see the docstring)."""
    reference = method_name(*METHODS[0])
    ref_accuracy = mean_curve(runs[reference], "accuracy")
    plateau = statistics.mean(ref_accuracy[-PLATEAU_ROUNDS:])
    before = ref_accuracy[-2 * PLATEAU_ROUNDS : -PLATEAU_ROUNDS]
    plateaued = bool(before) and abs(plateau - statistics.mean(before)) * 100 <= 1.0
    target = plateau - GOAL_ACCURACY_POINTS / 100
    methods: dict[str, Any] = {}
    for name, method_runs in runs.items():
        accuracy, cumulative = (mean_curve(method_runs, key) for key in ("accuracy", "bytes"))
        finals = [r["accuracy"][-1] for r in method_runs]
        methods[name] = {
            "seeds": len(method_runs),
            "accuracy_mean": accuracy,
            "accuracy_std": [
                statistics.stdev(v) if len(v) > 1 else 0.0
                for v in zip(*(r["accuracy"] for r in method_runs), strict=True)
            ],
            "bytes_mean": cumulative,
            "final_accuracy_mean": statistics.mean(finals),
            "final_accuracy_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "best_accuracy": max(accuracy),
            "level": statistics.mean(accuracy[-PLATEAU_ROUNDS:]),
            "bytes_per_round": (cumulative[-1] - cumulative[0]) / (len(cumulative) - 1),
            **{
                f"bytes_{way}_per_tier": {
                    tier: statistics.mean(r[f"bytes_{way}_per_tier"][tier] for r in method_runs)
                    for tier in TIERS
                }
                for way in ("up", "down")
            },
            "bytes_to_plateau": first_within(accuracy, cumulative, target),
        }
    ref_bytes = methods[reference]["bytes_to_plateau"]
    for stats in methods.values():
        mine = stats["bytes_to_plateau"]
        stats["bytes_ratio"] = ref_bytes / mine if mine and ref_bytes else None
        stats["accuracy_at_tenth_bytes"] = (
            at_bytes(stats["accuracy_mean"], stats["bytes_mean"], ref_bytes / GOAL_BYTES_RATIO)
            if ref_bytes
            else None
        )
        stats["points_below_plateau"] = 100 * (plateau - stats["level"])
    hydra = methods[method_name(*METHODS[1])]
    return {
        "reference": reference,
        "plateau": plateau,
        "plateaued": plateaued,
        "methods": methods,
        "goal_met": plateaued
        and hydra["points_below_plateau"] <= GOAL_ACCURACY_POINTS
        and hydra["bytes_ratio"] is not None
        and hydra["bytes_ratio"] >= GOAL_BYTES_RATIO,
    }


def _mb(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{value / 1e6:,.{decimals}f}"


def _number(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


TABLE_COLUMNS = (
    "method",
    "seeds",
    "final accuracy",
    "best mean accuracy",
    f"last {PLATEAU_ROUNDS} rounds",
    "MB / round",
    "MB down / up per round, site s/m/l",
    "MB to plateau - 1 pt",
    "fewer bytes than FedAvg",
    "accuracy at 1/10 of FedAvg's MB",
)


def table_rows(summary: dict[str, Any]) -> list[list[str]]:
    rows = []
    for name, s in summary["methods"].items():
        per_site = (
            "/".join(_mb(s["bytes_down_per_tier"][t], 2) for t in TIERS)
            + " / "
            + "/".join(_mb(s["bytes_up_per_tier"][t], 2) for t in TIERS)
        )
        rows.append(
            [
                name,
                str(s["seeds"]),
                f"{s['final_accuracy_mean']:.3f} ± {s['final_accuracy_std']:.3f}",
                f"{s['best_accuracy']:.3f}",
                f"{s['level']:.3f}",
                _mb(s["bytes_per_round"]),
                per_site,
                _mb(s["bytes_to_plateau"]),
                _number(s["bytes_ratio"], ".1f") + ("x" if s["bytes_ratio"] else ""),
                _number(s["accuracy_at_tenth_bytes"], ".3f"),
            ]
        )
    return rows


def headline(summary: dict[str, Any]) -> str:
    hydra = summary["methods"][method_name(*METHODS[1])]
    plateau = (
        f"{summary['reference']} plateau {summary['plateau']:.3f} (mean of its last "
        f"{PLATEAU_ROUNDS} rounds; {'plateaued' if summary['plateaued'] else 'NOT plateaued'})"
    )
    reached = (
        f"first within 1 point with {hydra['bytes_ratio']:.1f}x fewer bytes"
        if hydra["bytes_ratio"] is not None
        else "never within 1 point"
    )
    return (
        f"{plateau}; hydra's last {PLATEAU_ROUNDS} rounds {hydra['level']:.3f}, "
        f"{hydra['points_below_plateau']:.1f} points below; {reached}"
    )


def write_markdown(summary: dict[str, Any], path: Path) -> None:
    lines = [
        f"# {NAME}: accuracy against bytes on MiniLM ({summary['rounds']} rounds, 3 sites s/m/l)",
        "",
        headline(summary),
        "",
        "| " + " | ".join(TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
        *("| " + " | ".join(row) + " |" for row in table_rows(summary)),
        "",
        "Bytes: array payloads up + down, all sites, each round's evaluation download included; Hydra with its",
        "unselected layers frozen (every layer's LoRA factors downloaded). `python -m "
        "hydrafl.benchmarks.bytes_curves`.",
    ]
    path.write_text("\n".join(lines) + "\n")


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, (by_round, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, s in summary["methods"].items():
        mean, std = s["accuracy_mean"], s["accuracy_std"]
        low = [m - d for m, d in zip(mean, std, strict=True)]
        high = [m + d for m, d in zip(mean, std, strict=True)]
        rounds = range(len(mean))
        megabytes = [b / 1e6 for b in s["bytes_mean"]]
        (line,) = by_round.plot(rounds, mean, marker="o", markersize=3, label=name)
        by_round.fill_between(rounds, low, high, alpha=0.2, color=line.get_color())
        by_bytes.plot(megabytes, mean, marker="o", markersize=3, label=name)
        by_bytes.fill_between(megabytes, low, high, alpha=0.2, color=line.get_color())
    for ax in (by_round, by_bytes):
        ax.axhline(summary["plateau"], color="grey", linestyle="--", linewidth=1)
        ax.axhline(summary["plateau"] - GOAL_ACCURACY_POINTS / 100, color="grey", linestyle=":")
        ax.set_ylabel("accuracy (mean ± sd over seeds)")
        ax.legend(fontsize="small")
    by_round.set_xlabel("round")
    by_bytes.set_xscale("log")
    by_bytes.set_xlabel("cumulative MB (up + down, all sites)")
    fig.suptitle(headline(summary), fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, f"1 seed, {QUICK_ROUNDS} rounds of 1 local step")
    parser.add_argument(
        "--seeds", type=int, default=None, help="seeds per method (default: 3, quick: 1)"
    )
    parser.add_argument(
        "--baseline-seeds", type=int, default=None, help="FlexLoRA's seeds (default: --seeds)"
    )
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {ROUNDS})")
    parser.add_argument(
        "--work", type=Path, default=None, help="keep each run's folder here (reused when done)"
    )
    args = parser.parse_args()
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    seeds = args.seeds or (1 if args.quick else 3)
    baseline_seeds = seeds if args.baseline_seeds is None else args.baseline_seeds
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-bytes-") as tmp:
        runs = run(seeds, baseline_seeds, args.quick, rounds, args.work or Path(tmp))
    summary = {"benchmark": NAME, "quick": args.quick, "rounds": rounds, "runs": runs}
    summary |= analyse(runs)
    stem = args.out / NAME
    stem.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    write_markdown(summary, stem.with_suffix(".md"))
    plot(summary, stem.with_suffix(".png"))
    table = Table(title=f"{NAME}: {rounds} rounds")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="right")
    for row in table_rows(summary):
        table.add_row(*row)
    console = Console()
    console.print(table)
    console.print(f"{headline(summary)}: {verdict(summary['goal_met'])}")


if __name__ == "__main__":
    main()
