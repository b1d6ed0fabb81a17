"""Accuracy against epsilon: central differential privacy for FedAvg, FedAdam, DiLoCo and Hydra on an unequal split.

    python -m hydrafl.benchmarks.privacy [--out DIR] [--quick] [--strategies ...] [--targets ...]

Many small hospitals (20 sites, 800 clinical-text notes dealt by a Dirichlet(0.5) label partition, so sites hold
14 to 75 notes with skewed labels) train the tiny transformer (205,829 coordinates: 2 layers x 4 heads, which
Hydra's Hydra-nets slice) with each strategy at its defaults: fedavg, fedadam (server lr 0.03), diloco (outer
lr 0.7, Nesterov momentum 0.9) and hydra (the same outer step; sites in small, medium and large tiers train
different subnetworks), all on hydrafl's one central-DP mechanism. Every site trains every round, so each round
is one Gaussian mechanism on the sum of the clipped updates (noise z C / n per coordinate of the mean; for
Hydra z C / n_k on a coordinate n_k sites trained), and the run's epsilon is that mechanism composed over the
rounds. Central DP only: distributed DP (sites adding their share of the noise under secure aggregation) does
not exist in hydrafl yet. The noise's norm grows with the square root of the coordinates while the clipped
signal does not: at this many sites it is the measure of what central DP costs, not a recipe.

Per strategy, the clipping bound C is the median update norm of its non-private run's first round. For each
target epsilon (8, 4 and 1 at delta 1e-5, and 1000 and 128 to see where learning returns; `--targets` picks
others) the noise multiplier z is calibrated (`hydrafl.privacy.accountant`) for the run's rounds and sample
rate (20 of 20 sites), and the run reports the epsilon the accountants give after every round: `dp_epsilon`
(Renyi DP, which the calibration targets) and `dp_epsilon_exact` (the PLD accountant). Under DP, Hydra's
planning round scores from the global model's weights, so it reads no site data. 8 rounds (10 before the four strategies,
cut to keep the default run near a quarter of an hour on 2 cores). Written to --out: privacy.json (every
run's per-round accuracy and epsilon), privacy.md (the table) and privacy.png (accuracy per round per
strategy, final accuracy against epsilon).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.markdown import Markdown  # noqa: E402
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser  # noqa: E402
from hydrafl.client.site_app import client_app  # noqa: E402
from hydrafl.config import RunConfig  # noqa: E402
from hydrafl.privacy.accountant import RoundSample, calibrate_noise_multiplier  # noqa: E402
from hydrafl.privacy.clipping import l2_norm  # noqa: E402
from hydrafl.server.server_app import run_federation  # noqa: E402
from hydrafl.simulation.grid import InProcessGrid  # noqa: E402
from hydrafl.strategies import build_strategy  # noqa: E402

NAME = "privacy"
DELTA = 1e-5
PARTITION = "dirichlet:0.5"
"""Unequal sites: Dirichlet(0.5) over the labels (0.3 cannot deal 800 notes to 20 sites of at least 10)."""
STRATEGIES = ("fedavg", "fedadam", "diloco", "hydra")
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


FULL = Scale(
    sites=20, samples_per_site=40, rounds=8, local_steps=10, targets=(1000.0, 128.0, 8.0, 4.0, 1.0)
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

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201  (Grid's signature)
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


def run(scale: Scale) -> dict[str, Any]:
    """Per strategy: the non-private run (which sets its clip), then one run per target epsilon."""
    columns = (
        TextColumn("{task.description:<20}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    runs, clips = [], {}
    started = time.perf_counter()
    sample = RoundSample(scale.sites, scale.sites)
    noise = {
        target: calibrate_noise_multiplier(target, sample, scale.rounds, delta=DELTA)
        for target in scale.targets
    }
    with Progress(*columns) as progress:
        for strategy in scale.strategies:
            history, grid = one_run(run_config(scale, strategy), progress, f"{strategy} no DP")
            clip = clips[strategy] = statistics.median(grid.norms[0])
            runs.append(summarise(None, 0.0, clip, scale, history, strategy=strategy))
            for target, z in noise.items():
                cfg = run_config(
                    scale, strategy, dp_noise_multiplier=z, dp_clip=clip, dp_delta=DELTA
                )
                history, _ = one_run(cfg, progress, f"{strategy} epsilon {target:g}")
                runs.append(summarise(target, z, clip, scale, history, strategy=strategy))
    return {
        "benchmark": NAME,
        "scale": asdict(scale),
        "delta": DELTA,
        "clips": clips,
        "runs": runs,
        "seconds": time.perf_counter() - started,
    }


def summarise(
    target: float | None,
    z: float,
    clip: float,
    scale: Scale,
    history: list[dict[str, Any]],
    *,
    strategy: str = "",
) -> dict[str, Any]:
    """One run: its noise, the epsilon it spent (both accountants', as the run reported them) and its accuracy."""
    return {
        "strategy": strategy,
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
        f"# Accuracy against epsilon (clinical-text, {scale['sites']} sites, {scale['sites'] * scale['samples_per_site']} "
        f"notes dealt by {scale['partition']}, {scale['rounds']} rounds)",
        "",
        "Central DP only (distributed DP, `--secagg --dp-clip`, is not in this benchmark). Clip C per strategy = the median update "
        "norm of its non-private run's first round; every site trains every round; delta = "
        f"{summary['delta']:g}. Under DP, Hydra plans from the weights (no site data).",
        "",
        "| strategy | target epsilon | noise multiplier z | clip C | noise std per coordinate (z C / n) | "
        "epsilon spent (RDP) | epsilon spent (exact, PLD) | final accuracy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        target = "no DP" if run["target_epsilon"] is None else f"{run['target_epsilon']:g}"
        spent = "inf" if run["epsilon"] is None else f"{run['epsilon']:.3f}"
        exact = "inf" if run["epsilon_exact"] is None else f"{run['epsilon_exact']:.3f}"
        lines.append(
            f"| {run['strategy']} | {target} | {run['noise_multiplier']:.3f} | {run['clip']:.3f} | "
            f"{run['noise_std']:.4f} | {spent} | {exact} | {run['accuracy']:.3f} |"
        )
    if "seconds" in summary:
        lines += ["", f"{len(summary['runs'])} runs in {summary['seconds'] / 60:.1f} minutes."]
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    strategies = list(dict.fromkeys(run["strategy"] for run in summary["runs"]))
    fig = plt.figure(figsize=(3.2 * max(len(strategies), 2), 7.5))
    grid = fig.add_gridspec(2, len(strategies))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    final = fig.add_subplot(grid[1, :])
    for column, strategy in enumerate(strategies):
        per_round = fig.add_subplot(grid[0, column])
        runs = [run for run in summary["runs"] if run["strategy"] == strategy]
        for run in runs:
            label = (
                "no DP"
                if run["target_epsilon"] is None
                else f"epsilon {run['target_epsilon']:g} (z {run['noise_multiplier']:.2f})"
            )
            per_round.plot(
                range(len(run["accuracy_per_round"])),
                run["accuracy_per_round"],
                marker="o",
                label=label,
            )
        per_round.set_title(strategy)
        per_round.set_ylim(0.0, 1.0)
        per_round.set_xlabel("round")
        per_round.set_ylabel("accuracy")
        per_round.legend(fontsize="x-small")
        colour = colours[column % len(colours)]
        private = [run for run in runs if run["epsilon"] is not None]
        final.plot(
            [run["epsilon"] for run in private],
            [run["accuracy"] for run in private],
            marker="osD^v<>"[column % 7],
            markersize=max(9 - column, 3),
            color=colour,
            label=f"{strategy}, central DP",
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
    scale = replace(scale, strategies=strategies, targets=_floats(args.targets) or scale.targets)
    summary = {**run(scale), "quick": args.quick}
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}.png")
    Console().print(Markdown(markdown(summary)))


if __name__ == "__main__":
    main()
