"""AdamW vs Muon as the sites' inner optimizer: pseudo-gradient noise scale and direction as sites are added.

    python -m hydrafl.benchmarks.inner_optimizers [--out DIR] [--quick] [--strategy diloco] [--partition iid]

For each inner optimizer and each number of sites M (2, 4, 8, 16) this runs the same simulated federation
(`hydrafl simulate --diagnostics`: task tabular, a fixed number of samples per site, so the pooled data grows
with M) and reads, per round, from the round records:

- B_pg = tr(Cov[delta_site]) / ||mean delta||^2 of the sites' pseudo-gradients: adding sites helps while
  M < B_pg (the pseudo-gradient analogue of the critical batch size);
- cos(avg, full): the cosine between the averaged delta and the delta of one site trained on all M sites'
  pooled data from the same start weights, with the same batch size and steps.

The claim checked (MuLoCo): a whitening inner optimizer (Muon) keeps the averaged pseudo-gradient closer to
the full-data direction than AdamW at every M. Both optimizers use the same learning rate (Muon's update is
RMS-matched to AdamW's). Reported numbers are means over the training rounds; torch runs one thread.
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
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import run_strategy

NAME = "inner_optimizers"
OPTIMIZERS = ("adamw", "muon")


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    sites: tuple[int, ...]
    rounds: int
    local_steps: int
    samples_per_site: int
    batch_size: int = 16
    lr: float = 2e-3


FULL = Sweep(sites=(2, 4, 8, 16), rounds=4, local_steps=20, samples_per_site=200)
QUICK = Sweep(sites=(2, 4, 8, 16), rounds=2, local_steps=5, samples_per_site=60)


def run_config(
    sweep: Sweep, optimizer: str, sites: int, *, strategy: str, partition: str, seed: int
) -> RunConfig:
    return RunConfig(
        task="tabular",
        partition=partition,
        sites=sites,
        samples_per_site=sweep.samples_per_site,
        rounds=sweep.rounds,
        local_steps=sweep.local_steps,
        batch_size=sweep.batch_size,
        lr=sweep.lr,
        inner_optimizer=optimizer,
        strategy=strategy,
        seed=seed,
        diagnostics=True,
    )


def measure(cfg: RunConfig) -> dict[str, Any]:
    """One federation: per-round B_pg and cosine, their means over the training rounds, the final loss."""
    started = time.perf_counter()
    history = run_strategy(cfg, "inprocess")
    rounds = history[1:]
    scales = [r["noise_scale"] for r in rounds]
    cosines = [r["full_data_cosine"] for r in rounds]
    if any(value is None for value in scales + cosines):
        raise RuntimeError(
            f"{cfg.inner_optimizer} with {cfg.sites} sites: a round has no diagnostics; see the log"
        )
    return {
        "optimizer": cfg.inner_optimizer,
        "sites": cfg.sites,
        "noise_scale": scales,
        "full_data_cosine": cosines,
        "mean_noise_scale": statistics.fmean(scales),
        "mean_cosine": statistics.fmean(cosines),
        "final_loss": history[-1]["loss"],
        "seconds": time.perf_counter() - started,
    }


def table(summary: dict[str, Any]) -> Table:
    config = summary["config"]
    result = Table(
        title=f"inner optimizer vs sites: task tabular, {config['partition']} partition, {config['strategy']}, "
        f"{config['rounds']} rounds x {config['local_steps']} steps, {config['samples_per_site']} samples/site; "
        "means over rounds"
    )
    for column in (
        "sites",
        "AdamW B_pg",
        "Muon B_pg",
        "AdamW cos(avg, full)",
        "Muon cos(avg, full)",
        "AdamW loss",
        "Muon loss",
    ):
        result.add_column(column, justify="right")
    by_key = {(entry["optimizer"], entry["sites"]): entry for entry in summary["settings"]}
    for sites in config["sites"]:
        adamw, muon = by_key["adamw", sites], by_key["muon", sites]
        result.add_row(
            str(sites),
            f"{adamw['mean_noise_scale']:.3f}",
            f"{muon['mean_noise_scale']:.3f}",
            f"{adamw['mean_cosine']:.4f}",
            f"{muon['mean_cosine']:.4f}",
            f"{adamw['final_loss']:.4f}",
            f"{muon['final_loss']:.4f}",
        )
    return result


def plot(path: Path, summary: dict[str, Any]) -> None:
    figure, (scale_axis, cosine_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for optimizer in OPTIMIZERS:
        entries = sorted(
            (e for e in summary["settings"] if e["optimizer"] == optimizer),
            key=lambda e: e["sites"],
        )
        sites = [e["sites"] for e in entries]
        scale_axis.plot(
            sites, [e["mean_noise_scale"] for e in entries], marker="o", label=optimizer
        )
        cosine_axis.plot(sites, [e["mean_cosine"] for e in entries], marker="o", label=optimizer)
    scale_axis.set(
        xscale="log",
        yscale="log",
        xlabel="sites M",
        ylabel="B_pg (mean over rounds)",
        title="Pseudo-gradient noise scale",
    )
    cosine_axis.set(
        xscale="log",
        xlabel="sites M",
        ylabel="cos(averaged delta, full-data delta)",
        title="Direction vs full data",
    )
    for axis in (scale_axis, cosine_axis):
        axis.set_xticks(summary["config"]["sites"], [str(m) for m in summary["config"]["sites"]])
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(
    sweep: Sweep, *, strategy: str, partition: str, seed: int, show_progress: bool = True
) -> dict[str, Any]:
    config = {
        **dataclasses.asdict(sweep),
        "strategy": strategy,
        "partition": partition,
        "seed": seed,
    }
    summary: dict[str, Any] = {"benchmark": NAME, "config": config, "settings": []}
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        task = progress.add_task("settings", total=len(OPTIMIZERS) * len(sweep.sites))
        for optimizer in OPTIMIZERS:
            for sites in sweep.sites:
                progress.update(task, description=f"{optimizer}, {sites} sites")
                cfg = run_config(
                    sweep, optimizer, sites, strategy=strategy, partition=partition, seed=seed
                )
                summary["settings"].append(measure(cfg))
                progress.advance(task)
    by_key = {(e["optimizer"], e["sites"]): e for e in summary["settings"]}
    summary["muon_closer_at_every_m"] = all(
        by_key["muon", m]["mean_cosine"] > by_key["adamw", m]["mean_cosine"] for m in sweep.sites
    )
    return summary


def main() -> None:
    parser = benchmark_parser(__doc__, f"{QUICK}")
    parser.add_argument("--strategy", default="diloco", help="the outer strategy (default diloco)")
    parser.add_argument(
        "--partition", default="iid", help="iid (default), natural, dirichlet:ALPHA, ..."
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(
        logging.WARNING
    )  # one progress bar, not Flower's per-round lines
    summary = run(
        QUICK if args.quick else FULL,
        strategy=args.strategy,
        partition=args.partition,
        seed=args.seed,
    )
    summary["quick"] = args.quick
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(args.out / f"{NAME}.png", summary)
    console = Console(record=True, width=160)
    console.print(table(summary))
    claim = verdict(
        summary["muon_closer_at_every_m"], "Muon closer to full data at every M", "not at every M"
    )
    console.print(
        f"MuLoCo claim (Muon inner keeps the averaged delta closer to the full-data delta): {claim}"
    )
    (args.out / f"{NAME}.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
