"""Accuracy against epsilon: central and distributed differential privacy for FedAvg, FedAdam, DiLoCo and Hydra on
an unequal split.

    python -m hydrafl.benchmarks.privacy [--out DIR] [--quick] [--strategies ...] [--targets ...] [--mechanisms ...]

Many small hospitals (20 sites, 800 clinical-text notes dealt by a Dirichlet(0.5) label partition, so sites hold
14 to 75 notes with skewed labels) train the tiny transformer (205,829 coordinates: 2 layers x 4 heads, which
Hydra's Hydra-nets slice) with each strategy at its defaults: fedavg, fedadam (server lr 0.03), diloco (outer
lr 0.7, Nesterov momentum 0.9) and hydra (the same outer step; sites in small, medium and large tiers train
different subnetworks). Every site trains every round, so each round is one mechanism on the sum of the
clipped updates, each site counted once (noise z C / n per coordinate of the mean; for Hydra z C / n_k on a
coordinate n_k sites trained), and the run's epsilon is that mechanism composed over the rounds. Two
mechanisms: central DP (the coordinator adds Gaussian noise) and distributed DP (`--secagg --dp-clip`: each
site clips, rounds onto the secure-aggregation lattice and adds its Skellam share on every coordinate before
masking, so the coordinator decodes only the noised sum; accounted by Renyi DP at integer orders, as there is
no exact PLD bound for the Skellam). The noise's norm grows with the square root of the coordinates while the
clipped signal does not: at this many sites it is the measure of what DP costs, not a recipe.

Per strategy, the clipping bound C is the median update norm of its non-private run's first round. For each
target epsilon (8, 4 and 1 at delta 1e-5, and 1000 and 128 to see where learning returns; `--targets` picks
others) the noise multiplier z is calibrated (`hydrafl.privacy.accountant`) for the run's rounds and sample
rate (20 of 20 sites), per mechanism, and the run reports the epsilon the accountants give after every round:
`dp_epsilon` (Renyi DP, which the calibration targets) and, for central DP, `dp_epsilon_exact` (the PLD
accountant). Under DP, Hydra's planning round scores from the global model's weights, so it reads no site
data. 8 rounds (10 before the four strategies, cut to keep the central runs near a quarter of an hour on 2
cores; distributed runs add secure aggregation's cost). Written to --out: privacy.json (every run's
per-round accuracy and epsilon), privacy.md (the table) and privacy.png (accuracy per round per strategy,
final accuracy against epsilon).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.markdown import Markdown
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.client.site_app import client_app
from hydrafl.config import RunConfig
from hydrafl.privacy.accountant import (
    RoundSample,
    calibrate_distributed_noise_multiplier,
    calibrate_noise_multiplier,
)
from hydrafl.privacy.clipping import l2_norm
from hydrafl.server.server_app import run_federation
from hydrafl.simulation.grid import InProcessGrid
from hydrafl.strategies import build_strategy

NAME = "privacy"
DELTA = 1e-5
PARTITION = "dirichlet:0.5"
"""Unequal sites: Dirichlet(0.5) over the labels (0.3 cannot deal 800 notes to 20 sites of at least 10)."""
STRATEGIES = ("fedavg", "fedadam", "diloco", "hydra")
MECHANISMS = ("central", "distributed")
"""central: the coordinator noises (Gaussian); distributed: the sites noise under secure aggregation (Skellam)."""
TIERS = "small,medium,large"
"""Hydra's resource tiers, cycling over the sites, so they train different subnetworks."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    samples_per_site: int
    rounds: int
    local_steps: int
    targets: tuple[float, ...]
    """Target epsilons of the private runs (the non-private run comes first)."""
    partition: str = PARTITION
    strategies: tuple[str, ...] = STRATEGIES
    mechanisms: tuple[str, ...] = MECHANISMS


FULL = Scale(
    sites=20, samples_per_site=40, rounds=8, local_steps=10, targets=(8.0, 1000.0, 1.0, 128.0, 4.0)
)
QUICK = Scale(sites=3, samples_per_site=40, rounds=2, local_steps=2, targets=(4.0,))


def run_config(scale: Scale, strategy: str, **dp: Any) -> RunConfig:
    tiers = {"site_tiers": TIERS} if strategy == "hydra" else {}
    return RunConfig.build(
        task="clinical-text",
        strategy=strategy,
        partition=scale.partition,
        sites=scale.sites,
        samples_per_site=scale.samples_per_site,
        rounds=scale.rounds,
        local_steps=scale.local_steps,
        batch_size=16,
        lr=5e-3,
        **tiers,
        **dp,
    )


class NormProbe(InProcessGrid):
    """The in-process grid, noting the L2 norms of each training round's updates (to choose the clip from)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.norms: list[list[float]] = []

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(super().send_and_receive(messages, timeout=timeout))
        norms = [
            l2_norm({name: torch.from_numpy(array.numpy()) for name, array in record.items()})
            for reply in replies
            if reply.metadata.message_type == "train" and not reply.has_error()
            for record in reply.content.array_records.values()
        ]
        if norms:
            self.norms.append(norms)
        return replies


def one_run(
    cfg: RunConfig, progress: Progress, label: str
) -> tuple[list[dict[str, Any]], NormProbe]:
    task = progress.add_task(label, total=cfg.rounds)
    grid = NormProbe(client_app, cfg.sites, cfg.to_flower())

    def on_round(record: Any) -> None:
        progress.update(task, completed=record.round)

    history = run_federation(grid, cfg, strategy=build_strategy(cfg), on_round=on_round).history
    return history, grid


def run(scale: Scale, save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Each strategy's non-private run (which sets its clip), then per target epsilon (in the scale's order,
    most telling first), per mechanism, each strategy's private run; `save` gets the summary after every run,
    so a run cut short leaves every target it finished."""
    columns = (
        TextColumn("{task.description:<24}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    started = time.perf_counter()
    summary: dict[str, Any] = {
        "benchmark": NAME,
        "scale": asdict(scale),
        "delta": DELTA,
        "clips": {},
        "runs": [],
    }
    noise = calibrated(scale)
    planned = [
        (target, mechanism, strategy)
        for target in scale.targets
        for mechanism in scale.mechanisms
        for strategy in scale.strategies
    ]
    with Progress(*columns) as progress:
        overall = progress.add_task("all runs", total=len(scale.strategies) + len(planned))

        def record(run_summary: dict[str, Any]) -> None:
            summary["runs"].append(run_summary)
            summary["seconds"] = time.perf_counter() - started
            progress.advance(overall)
            if save is not None:
                save(summary)

        for strategy in scale.strategies:
            history, grid = one_run(run_config(scale, strategy), progress, f"{strategy} no DP")
            clip = summary["clips"][strategy] = statistics.median(grid.norms[0])
            record(summarise(None, 0.0, clip, scale, history, strategy=strategy))
        for target, mechanism, strategy in planned:
            z, clip = noise[mechanism, target], summary["clips"][strategy]
            cfg = run_config(
                scale,
                strategy,
                dp_noise_multiplier=z,
                dp_clip=clip,
                dp_delta=DELTA,
                secagg=mechanism == "distributed",
            )
            run_started = time.perf_counter()
            history, _ = one_run(cfg, progress, f"{strategy} {mechanism[:4]}. eps {target:g}")
            record(
                {
                    **summarise(
                        target, z, clip, scale, history, strategy=strategy, mechanism=mechanism
                    ),
                    "seconds": time.perf_counter() - run_started,
                }
            )
    return summary


def calibrated(scale: Scale) -> dict[tuple[str, float], float]:
    """Per (mechanism, target epsilon): the noise multiplier whose run spends the target by its own accountant."""
    sample = RoundSample(scale.sites, scale.sites)
    return {
        (mechanism, target): (
            calibrate_distributed_noise_multiplier(target, scale.rounds, delta=DELTA)
            if mechanism == "distributed"
            else calibrate_noise_multiplier(target, sample, scale.rounds, delta=DELTA)
        )
        for mechanism in scale.mechanisms
        for target in scale.targets
    }


def summarise(
    target: float | None,
    z: float,
    clip: float,
    scale: Scale,
    history: list[dict[str, Any]],
    *,
    strategy: str = "",
    mechanism: str = "none",
) -> dict[str, Any]:
    """One run: its noise, the epsilon it spent (both accountants', as the run reported them) and its accuracy."""
    return {
        "strategy": strategy,
        "mechanism": mechanism,
        "target_epsilon": target,
        "noise_multiplier": z,
        "clip": clip,
        "noise_std": z * clip / scale.sites,
        "epsilon": history[-1]["dp_epsilon"],
        "epsilon_exact": history[-1].get("dp_epsilon_exact"),
        "accuracy": history[-1]["accuracy"],
        "accuracy_per_round": [r["accuracy"] for r in history],
        "epsilon_per_round": [r["dp_epsilon"] for r in history[1:]],
        "epsilon_exact_per_round": [r.get("dp_epsilon_exact") for r in history[1:]],
    }


def markdown(summary: dict[str, Any]) -> str:
    scale = summary["scale"]
    lines = [
        f"# Accuracy against epsilon (clinical-text, {scale['sites']} sites, "
        f"{scale['sites'] * scale['samples_per_site']} notes dealt by {scale['partition']}, {scale['rounds']} rounds)",
        "",
        "Central DP (the coordinator adds Gaussian noise) beside distributed DP (`--secagg --dp-clip`: each "
        "site adds its Skellam share before masking; the coordinator sees only the noised sum). Clip C per "
        "strategy = the median update norm of its non-private run's first round; every site trains every "
        f"round; delta = {summary['delta']:g}; replace-one neighbours. Under DP, Hydra plans from the weights "
        "(no site data). Distributed DP has no exact (PLD) epsilon: the Skellam's one bound is Renyi DP at "
        "integer orders (Agarwal et al. 2021, Thm 3.5), so its z is calibrated to that and n/a stands in the "
        "exact column.",
        "",
        "| strategy | mechanism | target epsilon | noise multiplier z | clip C | noise std per coordinate "
        "(z C / n) | epsilon spent (RDP) | epsilon spent (exact, PLD) | final accuracy | minutes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in ordered(summary["runs"]):
        target = "no DP" if run["target_epsilon"] is None else f"{run['target_epsilon']:g}"
        mechanism = run.get("mechanism", "central")
        spent = "inf" if run["epsilon"] is None else f"{run['epsilon']:.3f}"
        exact = "inf" if run["target_epsilon"] is None else "n/a"
        if run["epsilon_exact"] is not None:
            exact = f"{run['epsilon_exact']:.3f}"
        minutes = f"{run['seconds'] / 60:.1f}" if "seconds" in run else ""
        lines.append(
            f"| {run['strategy']} | {mechanism} | {target} | {run['noise_multiplier']:.3f} | "
            f"{run['clip']:.3f} | {run['noise_std']:.4f} | {spent} | {exact} | {run['accuracy']:.3f} | "
            f"{minutes} |"
        )
    if "seconds" in summary:
        lines += ["", f"{len(summary['runs'])} runs in {summary['seconds'] / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"


def ordered(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs by strategy (in the order they first ran), then no DP, central, distributed, then epsilon from large."""
    strategies = list(dict.fromkeys(run["strategy"] for run in runs))
    mechanisms = ("none", *MECHANISMS)
    return sorted(
        runs,
        key=lambda run: (
            strategies.index(run["strategy"]),
            mechanisms.index(run.get("mechanism", "central")),
            -(run["target_epsilon"] or math.inf),
        ),
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    strategies = list(dict.fromkeys(run["strategy"] for run in summary["runs"]))
    fig = plt.figure(figsize=(3.2 * max(len(strategies), 2), 7.5))
    grid = fig.add_gridspec(2, len(strategies))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    final = fig.add_subplot(grid[1, :])
    for column, strategy in enumerate(strategies):
        per_round = fig.add_subplot(grid[0, column])
        runs = [run for run in ordered(summary["runs"]) if run["strategy"] == strategy]
        for run in runs:
            label = (
                "no DP"
                if run["target_epsilon"] is None
                else f"{run['mechanism'][:4]}. eps {run['target_epsilon']:g}"
            )
            per_round.plot(
                range(len(run["accuracy_per_round"])),
                run["accuracy_per_round"],
                marker="o",
                linestyle=":" if run.get("mechanism") == "distributed" else "-",
                label=label,
            )
        per_round.set_title(strategy)
        per_round.set_ylim(0.0, 1.0)
        per_round.set_xlabel("round")
        per_round.set_ylabel("accuracy")
        per_round.legend(fontsize="x-small")
        colour = colours[column % len(colours)]
        for mechanism, style in (("central", "-"), ("distributed", ":")):
            private = [
                run
                for run in runs
                if run["epsilon"] is not None and run.get("mechanism", "central") == mechanism
            ]
            if private:
                final.plot(
                    [run["epsilon"] for run in private],
                    [run["accuracy"] for run in private],
                    linestyle=style,
                    marker="osD^v<>"[column % 7],
                    markersize=max(9 - column, 3),
                    color=colour,
                    label=f"{strategy}, {mechanism} DP",
                )
        baseline = next(
            (run["accuracy"] for run in runs if run["target_epsilon"] is None), math.nan
        )
        final.axhline(baseline, linestyle="--", color=colour, label=f"{strategy}, no DP")
    final.set_xscale("log")
    final.set_xlabel(f"epsilon spent, RDP (delta {summary['delta']:g})")
    final.set_ylabel("final accuracy")
    final.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(value) for value in text.split(",") if value.strip())


def main() -> None:
    parser = benchmark_parser(
        __doc__, "3 sites, 2 rounds, each strategy without DP and at epsilon 4"
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated strategies"
    )
    parser.add_argument(
        "--mechanisms",
        default=",".join(MECHANISMS),
        help="comma-separated DP mechanisms: central, distributed",
    )
    parser.add_argument(
        "--targets",
        default="",
        help="comma-separated target epsilons (default: 1000,128,8,4,1; quick: 4)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(
        logging.WARNING
    )  # Flower logs every round's sampling: hundreds of lines
    scale = QUICK if args.quick else FULL
    strategies = tuple(name.strip() for name in args.strategies.split(",") if name.strip())
    mechanisms = tuple(name.strip() for name in args.mechanisms.split(",") if name.strip())
    scale = replace(
        scale,
        strategies=strategies,
        mechanisms=mechanisms,
        targets=_floats(args.targets) or scale.targets,
    )

    def save(summary: dict[str, Any]) -> None:
        summary = {**summary, "quick": args.quick}
        (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
        (args.out / f"{NAME}.md").write_text(markdown(summary))
        plot(summary, args.out / f"{NAME}.png")

    Console().print(Markdown(markdown(run(scale, save))))


if __name__ == "__main__":
    main()
