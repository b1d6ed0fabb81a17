"""SCAFFOLD vs FedAvg (and FedNova beside them) on a pathological non-IID partition: rounds to a target loss.

    python -m hydrafl.benchmarks.scaffold [--out DIR] [--quick] [--seeds 3] [--target-loss 1.10]

Six tabular sites, each holding one class (`--partition pathological:1`), train 20 local SGD steps a round:
the client drift SCAFFOLD's control variates correct (Karimireddy et al., 2020). Every strategy runs the same
sites, data, learning rate and rounds on the in-process grid; FedNova runs in its epochs mode, so each site's
local steps follow its data size. Per strategy and seed the table gives the first round whose evaluation loss
is at or below the target (none: not within the run), and the final loss; the PNG plots the mean loss.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import run_strategy

NAME = "scaffold"
STRATEGIES = ("fedavg", "scaffold", "fednova")
KNOBS = {"fednova": {"fednova_epochs": 3.0}}
"""FedNova's epochs mode: about the others' 20 steps on the mean site, more or fewer with the site's size."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int = 6
    samples_per_site: int = 100
    rounds: int = 15
    local_steps: int = 20
    batch_size: int = 16
    lr: float = 0.1
    partition: str = "pathological:1"


FULL = Scale()
QUICK = Scale(rounds=4, local_steps=5, samples_per_site=40)


def run_config(scale: Scale, strategy: str, seed: int) -> RunConfig:
    return RunConfig.build(
        task="tabular",
        partition=scale.partition,
        sites=scale.sites,
        samples_per_site=scale.samples_per_site,
        rounds=scale.rounds,
        local_steps=scale.local_steps,
        batch_size=scale.batch_size,
        lr=scale.lr,
        inner_optimizer="sgd",
        strategy=strategy,
        seed=seed,
        **KNOBS.get(strategy, {}),
    )


def rounds_to(losses: list[float], target: float) -> int | None:
    """The first round (1-based; round 0 is the initial model) whose loss is at most `target`."""
    return next((r for r, loss in enumerate(losses) if r and loss <= target), None)


def measure(cfg: RunConfig, target: float) -> dict[str, Any]:
    started = time.perf_counter()
    losses = [record["loss"] for record in run_strategy(cfg, "inprocess")]
    return {
        "strategy": cfg.strategy,
        "seed": cfg.seed,
        "losses": losses,
        "rounds_to_target": rounds_to(losses, target),
        "final_loss": losses[-1],
        "seconds": time.perf_counter() - started,
    }


def table(summary: dict[str, Any]) -> Table:
    config = summary["config"]
    result = Table(
        title=f"rounds to loss <= {config['target_loss']}: tabular, {config['sites']} sites, partition "
        f"{config['partition']}, {config['local_steps']} SGD steps x lr {config['lr']}, {config['rounds']} rounds"
    )
    for column in ("strategy", *(f"seed {s}" for s in config["seeds"]), "mean final loss"):
        result.add_column(column, justify="right")
    for strategy in STRATEGIES:
        runs = [r for r in summary["runs"] if r["strategy"] == strategy]
        result.add_row(
            strategy,
            *(
                "-" if r["rounds_to_target"] is None else str(r["rounds_to_target"])
                for r in sorted(runs, key=lambda r: r["seed"])
            ),
            f"{statistics.fmean(r['final_loss'] for r in runs):.4f}",
        )
    return result


def plot(path: Path, summary: dict[str, Any]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    for strategy in STRATEGIES:
        runs = [r["losses"] for r in summary["runs"] if r["strategy"] == strategy]
        mean = [statistics.fmean(column) for column in zip(*runs, strict=True)]
        axis.plot(
            range(len(mean)), mean, marker="o", label=f"{strategy} (mean of {len(runs)} seeds)"
        )
    axis.axhline(summary["config"]["target_loss"], color="grey", linestyle="--", label="target")
    axis.set(
        xlabel="round",
        ylabel="evaluation loss",
        yscale="log",
        title=f"Pathological non-IID ({summary['config']['partition']}): SCAFFOLD vs FedAvg",
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(scale: Scale, *, seeds: int, target: float, show_progress: bool = True) -> dict[str, Any]:
    config = {**dataclasses.asdict(scale), "seeds": list(range(seeds)), "target_loss": target}
    summary: dict[str, Any] = {"benchmark": NAME, "config": config, "runs": []}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        task = progress.add_task("runs", total=seeds * len(STRATEGIES))
        for seed in range(seeds):
            for strategy in STRATEGIES:
                progress.update(task, description=f"{strategy}, seed {seed}")
                summary["runs"].append(measure(run_config(scale, strategy, seed), target))
                progress.advance(task)
    by = {(r["strategy"], r["seed"]): r["rounds_to_target"] for r in summary["runs"]}
    never = scale.rounds + 1  # not reaching the target counts as later than any round
    summary["scaffold_fewer_rounds_every_seed"] = all(
        (by["scaffold", s] or never) < (by["fedavg", s] or never) for s in range(seeds)
    )
    return summary


def main() -> None:
    parser = benchmark_parser(__doc__, f"{QUICK}")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--target-loss", type=float, default=1.10)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)  # one progress bar, not Flower's lines
    torch.set_num_threads(1)
    summary = run(QUICK if args.quick else FULL, seeds=args.seeds, target=args.target_loss)
    summary["quick"] = args.quick
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(args.out / f"{NAME}.png", summary)
    console = Console(record=True, width=160)
    console.print(table(summary))
    claim = verdict(
        summary["scaffold_fewer_rounds_every_seed"],
        "SCAFFOLD reaches the target in fewer rounds than FedAvg on every seed",
        "NOT on every seed",
    )
    console.print(f"SCAFFOLD against client drift: {claim}")
    (args.out / f"{NAME}.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
