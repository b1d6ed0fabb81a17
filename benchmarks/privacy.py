"""Accuracy against epsilon: central differential privacy on the clinical-text task.

    python -m hydrafl.benchmarks.privacy [--out DIR] [--quick]

Many small hospitals (20 sites of 40 notes each) train the tiny transformer (205,829 coordinates) with DiLoCo at
outer lr 1 and no momentum (FedAvg over the streamed pseudo-gradients, on hydrafl's own central-DP path). Every
site trains every round, so each round is one Gaussian mechanism on the sum of the clipped updates (noise
z C / n per coordinate of the mean), and the run's epsilon is that mechanism composed over the rounds. The
noise's norm grows with the square root of the coordinates while the clipped signal does not: at this many
sites it is the measure of what central DP costs, not a recipe (rank-2 LoRA on the from-scratch model, 2,373
coordinates, did not learn even without DP at this scale).

The clipping bound C is the median update norm of a non-private run's first round. For each target epsilon
(1, 4 and 8 at delta 1e-5, and 32, 128 and 1000 to find where learning returns, and no DP) the noise multiplier z is calibrated (`hydrafl.privacy.accountant`) for
the run's rounds and sample rate (20 of 20 sites), and the run reports the epsilon the accountant gives after
every round (Renyi DP, which the calibration targets, and beside it the exact PLD one). Written to --out:
privacy.json (every run's per-round accuracy and epsilon), privacy.md (the table) and privacy.png (accuracy per
round, final accuracy against epsilon).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass
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
from hydrafl.config import RunConfig  # noqa: E402
from hydrafl.privacy.accountant import RoundSample, calibrate_noise_multiplier  # noqa: E402
from hydrafl.privacy.clipping import l2_norm  # noqa: E402
from hydrafl.server_app import run_federation  # noqa: E402
from hydrafl.simulation.grid import InProcessGrid  # noqa: E402
from hydrafl.site_app import client_app  # noqa: E402
from hydrafl.strategies import build_strategy  # noqa: E402

NAME = "privacy"
DELTA = 1e-5


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    samples_per_site: int
    rounds: int
    local_steps: int
    targets: tuple[float, ...]
    """Target epsilons of the private runs (the non-private run comes first)."""


FULL = Scale(sites=20, samples_per_site=40, rounds=10, local_steps=10, targets=(1000.0, 128.0, 32.0, 8.0, 4.0, 1.0))
QUICK = Scale(sites=3, samples_per_site=30, rounds=2, local_steps=2, targets=(4.0,))


def run_config(scale: Scale, **dp: Any) -> RunConfig:
    return RunConfig.build(
        task="clinical-text", strategy="diloco", outer_lr=1.0, outer_momentum=0.0, sites=scale.sites,
        samples_per_site=scale.samples_per_site, rounds=scale.rounds, local_steps=scale.local_steps, batch_size=16,
        lr=5e-3, **dp,
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
            for reply in replies if reply.metadata.message_type == "train" and not reply.has_error()
            for record in reply.content.array_records.values()
        ]
        if norms:
            self.norms.append(norms)
        return replies


def one_run(cfg: RunConfig, progress: Progress, label: str) -> tuple[list[dict[str, Any]], NormProbe]:
    task = progress.add_task(label, total=cfg.rounds)
    grid = NormProbe(client_app, cfg.sites, cfg.to_flower())

    def on_round(record: Any) -> None:
        progress.update(task, completed=record.round)

    history = run_federation(grid, cfg, strategy=build_strategy(cfg), on_round=on_round).history
    return history, grid


def run(scale: Scale) -> dict[str, Any]:
    """The non-private run (which sets the clip), then one run per target epsilon."""
    columns = (TextColumn("{task.description:<12}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    runs = []
    with Progress(*columns) as progress:
        history, grid = one_run(run_config(scale), progress, "no DP")
        clip = statistics.median(grid.norms[0])
        runs.append(summarise(None, 0.0, clip, scale, history))
        sample = RoundSample(scale.sites, scale.sites)
        for target in scale.targets:
            z = calibrate_noise_multiplier(target, sample, scale.rounds, delta=DELTA)
            cfg = run_config(scale, dp_noise_multiplier=z, dp_clip=clip, dp_delta=DELTA)
            history, _ = one_run(cfg, progress, f"epsilon {target:g}")
            runs.append(summarise(target, z, clip, scale, history))
    return {"benchmark": NAME, "scale": asdict(scale), "delta": DELTA, "clip": clip, "runs": runs}


def summarise(target: float | None, z: float, clip: float, scale: Scale, history: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: its noise, the epsilon it spent (the accountant's, as the run reported it) and its accuracy."""
    return {
        "target_epsilon": target,
        "noise_multiplier": z,
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
        f"# Accuracy against epsilon (clinical-text, {scale['sites']} sites x {scale['samples_per_site']} notes, "
        f"{scale['rounds']} rounds)",
        "",
        f"Clip C = {summary['clip']:.3f} (median update norm of the non-private run's first round); every site "
        f"trains every round; delta = {summary['delta']:g}.",
        "",
        "| target epsilon | noise multiplier z | noise std per coordinate (z C / n) | epsilon spent (RDP) | "
        "epsilon spent (exact, PLD) | final accuracy |",
        "|---|---|---|---|---|---|",
    ]
    for run in summary["runs"]:
        target = "no DP" if run["target_epsilon"] is None else f"{run['target_epsilon']:g}"
        spent = "inf" if run["epsilon"] is None else f"{run['epsilon']:.3f}"
        exact = "inf" if run["epsilon_exact"] is None else f"{run['epsilon_exact']:.3f}"
        lines.append(f"| {target} | {run['noise_multiplier']:.3f} | {run['noise_std']:.4f} | {spent} | {exact} | "
                     f"{run['accuracy']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, (per_round, final) = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in summary["runs"]:
        label = "no DP" if run["target_epsilon"] is None else f"epsilon {run['target_epsilon']:g} (z {run['noise_multiplier']:.2f})"
        per_round.plot(range(len(run["accuracy_per_round"])), run["accuracy_per_round"], marker="o", label=label)
    per_round.set_xlabel("round")
    per_round.set_ylabel("accuracy")
    per_round.legend(fontsize="small")
    private = [run for run in summary["runs"] if run["epsilon"] is not None]
    final.plot([run["epsilon"] for run in private], [run["accuracy"] for run in private], marker="o", label="central DP")
    baseline = next((run["accuracy"] for run in summary["runs"] if run["target_epsilon"] is None), math.nan)
    final.axhline(baseline, linestyle="--", color="grey", label="no DP")
    final.set_xscale("log")
    final.set_xlabel(f"epsilon spent (delta {summary['delta']:g})")
    final.set_ylabel("final accuracy")
    final.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    args = benchmark_parser(__doc__, "3 sites, 2 rounds, no DP and epsilon 4").parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    summary = {**run(QUICK if args.quick else FULL), "quick": args.quick}
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(summary, args.out / f"{NAME}.png")
    Console().print(Markdown(markdown(summary)))


if __name__ == "__main__":
    main()
