"""Which seeded from-scratch model a user's image folder gets: the tiny ViT against the small CNN, on real images.

    python -m hydrafl.benchmarks.image_models [--out DIR] [--quick] [--seeds 0,1,2] [--rounds 8]

The real image set is scikit-learn's copy of the UCI handwritten digits (1,797 scanned 8x8 digits, 10
classes), written out as PNG files upscaled to the models' 32x32 in one sub-folder per class, exactly as a
user's folder looks. Each model runs `hydrafl simulate` on that folder (`data`, fedavg, iid over 4 sites,
the run defaults for steps, batch and learning rate) with each seed; the table gives the seed-mean test
accuracy per round, the final accuracy's mean and spread (max - min over seeds), parameters and seconds.
The model with the higher final mean is `catalog.IMAGE_FOLDER_MODEL`, what `model = "tiny"` builds there.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from PIL import Image
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.catalog import IMAGE_FOLDER_MODEL
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import run_strategy

NAME = "image_models"
MODELS = ("cnn", "vit")
PIXELS = 32
"""The side the PNG files are written at: the image size every model reads (`data.image_cohort.IMAGE_SIZE`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    seeds: tuple[int, ...]
    rounds: int
    sites: int = 4
    per_class: int | None = None
    """Digits written per class; None writes all 1,797."""


FULL = Sweep(seeds=(0, 1, 2), rounds=8)
QUICK = Sweep(seeds=(0,), rounds=2, per_class=30)


def write_digits_folder(root: Path, per_class: int | None = None) -> Path:
    """scikit-learn's scanned digits as a user's image folder: root/<digit>/<index>.png, grayscale, upscaled from
    8x8 to `PIXELS` (bilinear); `per_class` keeps the first that many of each digit."""
    from sklearn.datasets import (
        load_digits,
    )  # the test extra's; only this benchmark and its test read it

    digits = load_digits()
    written = dict.fromkeys(range(10), 0)
    for index, (image, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        if per_class is not None and written[int(label)] >= per_class:
            continue
        folder = root / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        gray = Image.fromarray(
            (image * (255 / 16)).astype(np.uint8), mode="L"
        )  # scanner values are 0..16
        gray.resize((PIXELS, PIXELS), Image.Resampling.BILINEAR).save(folder / f"{index:04d}.png")
        written[int(label)] += 1
    return root


def measure(folder: Path, model: str, sweep: Sweep, seed: int) -> dict[str, Any]:
    """One fedavg federation on the folder: test accuracy per round (round 0 is the initial model)."""
    cfg = RunConfig(
        data=str(folder), model=model, sites=sweep.sites, rounds=sweep.rounds, seed=seed
    )
    started = time.perf_counter()
    history = run_strategy(cfg, "inprocess")
    return {
        "model": model,
        "seed": seed,
        "accuracy": [entry["accuracy"] for entry in history],
        "seconds": time.perf_counter() - started,
    }


def parameter_count(folder: Path, model: str) -> int:
    from hydrafl.data import load_cohort
    from hydrafl.models import build_model

    task = load_cohort(data_path=folder, num_sites=1).task
    return sum(p.numel() for p in build_model(task, model=model).parameters())


def summarise(runs: list[dict[str, Any]], model: str) -> dict[str, Any]:
    """Seed means per round, the final accuracy's mean and spread (max - min), and the mean seconds."""
    own = [run for run in runs if run["model"] == model]
    finals = [run["accuracy"][-1] for run in own]
    return {
        "mean_accuracy": [
            statistics.fmean(column)
            for column in zip(*(run["accuracy"] for run in own), strict=True)
        ],
        "final_mean": statistics.fmean(finals),
        "final_spread": max(finals) - min(finals),
        "seconds": statistics.fmean(run["seconds"] for run in own),
    }


def table(summary: dict[str, Any]) -> Table:
    config = summary["config"]
    result = Table(
        title=f"from-scratch image models on real digits ({summary['images']} images, {config['sites']} sites iid, "
        f"fedavg, {len(config['seeds'])} seeds): seed-mean test accuracy per round"
    )
    for column in (
        "model",
        "params",
        *(f"r{r}" for r in range(config["rounds"] + 1)),
        "final ± spread",
        "s/run",
    ):
        result.add_column(column, justify="right")
    for model, entry in summary["models"].items():
        result.add_row(
            model,
            f"{entry['params']:,}",
            *(f"{a:.3f}" for a in entry["mean_accuracy"]),
            f"{entry['final_mean']:.3f} ± {entry['final_spread']:.3f}",
            f"{entry['seconds']:.1f}",
        )
    return result


def plot(path: Path, summary: dict[str, Any]) -> None:
    figure, axis = plt.subplots(figsize=(7, 4))
    for run in summary["runs"]:
        axis.plot(run["accuracy"], color=f"C{MODELS.index(run['model'])}", alpha=0.25)
    for index, (model, entry) in enumerate(summary["models"].items()):
        axis.plot(
            entry["mean_accuracy"], color=f"C{index}", marker="o", label=f"{model} (seed mean)"
        )
    axis.axhline(0.1, color="gray", linestyle=":", label="chance")
    axis.set(
        xlabel="round",
        ylabel="test accuracy",
        ylim=(0, 1),
        title="Real digits as an image folder, fedavg",
    )
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(sweep: Sweep, folder: Path, *, show_progress: bool = True) -> dict[str, Any]:
    write_digits_folder(folder, sweep.per_class)
    images = sum(1 for _ in folder.rglob("*.png"))
    summary: dict[str, Any] = {
        "benchmark": NAME,
        "config": dataclasses.asdict(sweep),
        "images": images,
        "runs": [],
    }
    settings = list(itertools.product(MODELS, sweep.seeds))
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        for model, seed in progress.track(settings, description="models x seeds"):
            summary["runs"].append(measure(folder, model, sweep, seed))
    summary["models"] = {
        model: {**summarise(summary["runs"], model), "params": parameter_count(folder, model)}
        for model in MODELS
    }
    summary["winner"] = max(
        summary["models"], key=lambda model: summary["models"][model]["final_mean"]
    )
    summary["default"] = IMAGE_FOLDER_MODEL
    return summary


def main() -> None:
    parser = benchmark_parser(__doc__, f"{QUICK}")
    parser.add_argument(
        "--seeds", default="", help="comma-separated seeds (default 0,1,2; --quick 0)"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds per run (default 8; --quick 2)"
    )
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(
        logging.WARNING
    )  # one progress bar, not Flower's per-round lines
    sweep = QUICK if args.quick else FULL
    if args.seeds:
        sweep = dataclasses.replace(sweep, seeds=tuple(int(seed) for seed in args.seeds.split(",")))
    if args.rounds:
        sweep = dataclasses.replace(sweep, rounds=args.rounds)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        summary = run(sweep, Path(folder) / "digits")
    summary["quick"] = args.quick
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(args.out / f"{NAME}.png", summary)
    console = Console(record=True, width=160)
    console.print(table(summary))
    agrees = summary["winner"] == summary["default"]
    console.print(
        f"measured winner {summary['winner']}, default for an image folder {summary['default']}: "
        + verdict(agrees, "the default is the winner", "DEFAULT IS NOT THE WINNER")
    )
    (args.out / f"{NAME}.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
