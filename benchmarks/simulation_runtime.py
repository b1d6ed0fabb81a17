"""The same hydrafl federation on the in-process grid and on Flower's Ray simulation: wall time and peak memory.

    python -m hydrafl.benchmarks.simulation_runtime [--out DIR] [--quick]

Each run is a fresh process (`_simulation_worker`), so interpreter start, imports and Ray's cluster start are
counted, and no run can warm another. Repetitions alternate the backend order to spread the noise of a shared
machine evenly. Memory is the peak of the summed RSS of the whole process tree (Ray's GCS, raylet and worker
processes included), sampled every 50 ms; this process is a child subreaper, so daemons that detach from the
worker are still counted. Summed RSS counts shared pages (libraries, Ray's shared-memory object store) once per
process that maps them, so the summed anonymous memory ("private": RSS minus file-backed and shared-memory
pages) is reported too, as a lower bound.

Goal: in-process at least 3x faster and at most 1/3 of the memory of Ray.
"""

from __future__ import annotations

import ctypes
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import psutil
from matplotlib.ticker import MaxNLocator
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.config import RunConfig

NAME = "simulation_runtime"
BACKENDS = ("inprocess", "ray")
SAMPLE_S = 0.05
GOAL_TIME_RATIO = 3.0
GOAL_MEMORY_RATIO = 3.0
LOSS_TOLERANCE = 1e-6
PR_SET_CHILD_SUBREAPER = 36
MB = 1e6  # decimal megabytes


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    rounds: int
    reps: int


FULL = Scale(sites=10, rounds=3, reps=3)
QUICK = Scale(sites=2, rounds=1, reps=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Measurement:
    backend: str
    rep: int
    wall_s: float
    import_s: float
    run_s: float
    peak_rss_mb: float
    peak_private_mb: float
    peak_processes: int
    left_at_exit: list[str]
    terminated: int
    history: list[dict[str, Any]]


def workload(scale: Scale, run_dir: Path) -> RunConfig:
    """Small tabular federation: per-site compute is short, so what differs is the runtime's own cost."""
    return RunConfig(
        task="tabular",
        sites=scale.sites,
        rounds=scale.rounds,
        samples_per_site=64,
        local_steps=2,
        batch_size=16,
        strategy="fedavg",
        seed=0,
        run_dir=str(run_dir),
    )


def become_subreaper() -> None:
    """Orphaned grandchildren (daemonised Ray processes) re-parent to us, so the tree sum still sees them."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def tree_memory(root: psutil.Process) -> tuple[int, int, int]:
    """(summed RSS, summed anonymous RSS, process count) of every descendant of `root`; sizes in bytes."""
    rss = private = count = 0
    for process in root.children(recursive=True):
        try:
            info = process.memory_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        rss += info.rss
        private += info.rss - info.shared
        count += 1
    return rss, private, count


def measure(backend: str, rep: int, scale: Scale, work: Path) -> Measurement:
    """Run one backend in a fresh process; sample the tree's memory until the process exits."""
    run_dir, result, log = (
        work / f"{backend}-{rep}",
        work / f"{backend}-{rep}.json",
        work / f"{backend}-{rep}.log",
    )
    config = json.dumps(workload(scale, run_dir).to_flower())
    command = [
        sys.executable,
        "-m",
        "hydrafl.benchmarks._simulation_worker",
        backend,
        "--config",
        config,
    ]
    me = psutil.Process()
    peak_rss = peak_private = peak_count = 0
    with log.open("w") as log_file:
        started = time.perf_counter()
        worker = subprocess.Popen(
            [*command, "--result", str(result)], stdout=log_file, stderr=subprocess.STDOUT
        )
        while worker.poll() is None:
            rss, private, count = tree_memory(me)
            peak_rss, peak_private, peak_count = (
                max(peak_rss, rss),
                max(peak_private, private),
                max(peak_count, count),
            )
            time.sleep(SAMPLE_S)
        wall_s = time.perf_counter() - started
    left_at_exit, terminated = reap_leftovers(me)
    if worker.returncode != 0 or not result.exists():
        tail = "\n".join(log.read_text().splitlines()[-30:])
        raise RuntimeError(
            f"{backend} run {rep} failed (exit {worker.returncode}); log tail:\n{tail}"
        )
    run = json.loads(result.read_text())
    return Measurement(
        backend=backend,
        rep=rep,
        wall_s=wall_s,
        import_s=run["import_s"],
        run_s=run["run_s"],
        peak_rss_mb=peak_rss / MB,
        peak_private_mb=peak_private / MB,
        peak_processes=peak_count,
        left_at_exit=left_at_exit,
        terminated=terminated,
        history=run["history"],
    )


def reap_leftovers(me: psutil.Process, grace_s: float = 5.0) -> tuple[list[str], int]:
    """Processes a run left behind would skew the next run: name them, give them a grace period to exit,
    then end them; returns (their names, how many had to be terminated)."""
    leftovers = me.children(recursive=True)
    names = []
    for process in leftovers:
        try:
            names.append(process.name())
        except psutil.NoSuchProcess:
            names.append("<exited>")
    _, alive = psutil.wait_procs(leftovers, timeout=grace_s)
    for process in alive:
        process.terminate()
    psutil.wait_procs(alive, timeout=grace_s)
    return names, len(alive)


def max_round_diff(a: list[dict[str, Any]], b: list[dict[str, Any]], key: str) -> float:
    if len(a) != len(b):
        return float("inf")
    return max(abs(x[key] - y[key]) for x, y in zip(a, b, strict=True))


def identical(runs: list[Measurement]) -> bool:
    """Bit-identical per-round losses and accuracies across repetitions of one backend."""
    return all(
        max_round_diff(run.history, runs[0].history, key) == 0
        for run in runs
        for key in ("loss", "accuracy")
    )


def summarise(runs: list[Measurement], scale: Scale, quick: bool) -> dict[str, Any]:
    by_backend = {backend: [run for run in runs if run.backend == backend] for backend in BACKENDS}
    medians = {
        backend: {
            key: statistics.median(getattr(run, key) for run in group)
            for key in (
                "wall_s",
                "import_s",
                "run_s",
                "peak_rss_mb",
                "peak_private_mb",
                "peak_processes",
            )
        }
        for backend, group in by_backend.items()
    }
    time_ratio = medians["ray"]["wall_s"] / medians["inprocess"]["wall_s"]
    memory_ratio = medians["ray"]["peak_rss_mb"] / medians["inprocess"]["peak_rss_mb"]
    private_ratio = medians["ray"]["peak_private_mb"] / medians["inprocess"]["peak_private_mb"]
    pairs = [(a.history, b.history) for a in by_backend["inprocess"] for b in by_backend["ray"]]
    loss_diff = max(max_round_diff(a, b, "loss") for a, b in pairs)
    accuracy_diff = max(max_round_diff(a, b, "accuracy") for a, b in pairs)
    return {
        "benchmark": NAME,
        "quick": quick,
        "workload": {**workload(scale, Path("<per run>")).to_flower(), "reps": scale.reps},
        "runs": [asdict(run) for run in runs],
        "median": medians,
        "ratios": {
            "time_ray_over_inprocess": time_ratio,
            "memory_ray_over_inprocess": memory_ratio,
            "private_memory_ray_over_inprocess": private_ratio,
            "goal_time": GOAL_TIME_RATIO,
            "goal_memory": GOAL_MEMORY_RATIO,
            "time_goal_met": time_ratio >= GOAL_TIME_RATIO,
            "memory_goal_met": memory_ratio >= GOAL_MEMORY_RATIO,
        },
        "equality": {
            "max_abs_loss_diff": loss_diff,
            "max_abs_accuracy_diff": accuracy_diff,
            "tolerance": LOSS_TOLERANCE,
            "passed": loss_diff <= LOSS_TOLERANCE and accuracy_diff <= LOSS_TOLERANCE,
            "inprocess_reps_identical": identical(by_backend["inprocess"]),
            "ray_reps_identical": identical(by_backend["ray"]),
            "final_loss": {
                backend: group[0].history[-1]["loss"] for backend, group in by_backend.items()
            },
            "final_accuracy": {
                backend: group[0].history[-1]["accuracy"] for backend, group in by_backend.items()
            },
        },
    }


def print_table(summary: dict[str, Any]) -> None:
    median, ratios, equality, work = (
        summary["median"],
        summary["ratios"],
        summary["equality"],
        summary["workload"],
    )
    table = Table(
        title=f"{work['sites']} sites x {work['rounds']} rounds ({work['task']}, {work['strategy']}): "
        f"median of {work['reps']} fresh-process runs"
    )
    for column in ("backend", "wall s", "imports s", "run s", "RSS MB", "private MB", "procs"):
        table.add_column(column, justify="right")
    for backend in BACKENDS:
        m = median[backend]
        cells = (
            m["wall_s"],
            m["import_s"],
            m["run_s"],
            m["peak_rss_mb"],
            m["peak_private_mb"],
            m["peak_processes"],
        )
        table.add_row(
            backend,
            *(f"{value:.1f}" for value in cells[:3]),
            *(f"{value:.0f}" for value in cells[3:]),
        )
    table.add_row(
        "ray/inproc",
        f"{ratios['time_ray_over_inprocess']:.2f}x",
        "",
        f"{median['ray']['run_s'] / median['inprocess']['run_s']:.2f}x",
        f"{ratios['memory_ray_over_inprocess']:.2f}x",
        f"{ratios['private_memory_ray_over_inprocess']:.2f}x",
        "",
    )
    console = Console()
    console.print(table)
    console.print(
        f"time ratio {verdict(ratios['time_goal_met'])}, memory ratio {verdict(ratios['memory_goal_met'])} "
        f"(goal: ray/inprocess >= {GOAL_TIME_RATIO:g}x time and >= {GOAL_MEMORY_RATIO:g}x memory)"
    )
    console.print(
        f"same results: max |loss diff| {equality['max_abs_loss_diff']:.2e}, max |accuracy diff| "
        f"{equality['max_abs_accuracy_diff']:.2e} (tolerance {equality['tolerance']:g}): "
        f"{verdict(equality['passed'], 'PASS', 'FAIL')}"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    runs = summary["runs"]
    colors = {"inprocess": "tab:blue", "ray": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        (axes[0], "wall_s", "wall time (s)"),
        (axes[1], "peak_rss_mb", "peak RSS of process tree (MB)"),
    )
    for ax, key, label in panels:
        for i, backend in enumerate(BACKENDS):
            values = [run[key] for run in runs if run["backend"] == backend]
            ax.bar(i, summary["median"][backend][key], color=colors[backend], alpha=0.6)
            ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
        ax.set_xticks(range(len(BACKENDS)), BACKENDS)
        ax.set_ylabel(label)
    for backend in BACKENDS:
        history = next(run["history"] for run in runs if run["backend"] == backend)
        axes[2].plot(
            [r["round"] for r in history],
            [r["loss"] for r in history],
            marker="o",
            label=backend,
            color=colors[backend],
            linestyle="-" if backend == "inprocess" else "--",
        )
    axes[2].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[2].set_xlabel("round")
    axes[2].set_ylabel("federated loss")
    axes[2].legend()
    ratios = summary["ratios"]
    fig.suptitle(
        f"ray / inprocess: {ratios['time_ray_over_inprocess']:.2f}x time, "
        f"{ratios['memory_ray_over_inprocess']:.2f}x memory (goal >= {GOAL_TIME_RATIO:g}x each)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    become_subreaper()
    runs = []
    with tempfile.TemporaryDirectory(prefix="hydrafl-bench-") as work:
        for rep in range(scale.reps):
            for backend in BACKENDS if rep % 2 == 0 else BACKENDS[::-1]:
                runs.append(measure(backend, rep, scale, Path(work)))
                print(
                    f"rep {rep} {backend}: {runs[-1].wall_s:.1f} s, {runs[-1].peak_rss_mb:.0f} MB",
                    flush=True,
                )
    summary = summarise(runs, scale, args.quick)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_table(summary)


if __name__ == "__main__":
    main()
