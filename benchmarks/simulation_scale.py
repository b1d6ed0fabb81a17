"""Simulation at scale and start-up: 1,000 simulated sites on one and on every core and on Ray, and the whole-process
wall time of a 10-site stock Flower app through hydrafl against Flower + Ray.

    python -m hydrafl.benchmarks.simulation_scale [--out DIR] [--quick] [--reps N]

Part 1 runs `hydrafl simulate --task tabular --sites 1000 --fraction-train 0.1 --rounds 3 --strategies fedavg`
in a fresh process with --workers 1 (every site in one process), with --workers 0 (one worker per core) and with
--backend ray; wall time from start to exit, and the peak summed RSS of the process tree (as in
`simulation_runtime`). The worker runs must end with bit-identical final arrays and the same history. Goal: under
5 minutes.

Part 2 runs the stock app (`_stock_app`, NumPy only, 10 sites, 3 rounds) in fresh processes (`_stock_worker`),
through `hydrafl.simulation.run_app` and through Flower's `run_simulation` on Ray, alternating, `--reps` times;
beside them the floors: an empty interpreter and `import flwr.serverapp, flwr.clientapp` (what any Flower
runtime imports). Goal: Ray / hydrafl >= 10x. The machine is shared: the 1-minute load average is recorded with
every run.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.benchmarks.simulation_runtime import (
    MB,
    SAMPLE_S,
    become_subreaper,
    reap_leftovers,
    tree_memory,
)

NAME = "simulation_scale"
GOAL_SCALE_S = 300.0
GOAL_STARTUP_RATIO = 10.0
SCALE_TIMEOUT_S = 3600.0
SCALE_RUNS = {
    "hydrafl, 1 worker": ["--workers", "1"],
    "hydrafl, 1 worker per core": ["--workers", "0"],
    "ray": ["--backend", "ray"],
}
FLOORS = {
    "python -c pass": ["-c", "pass"],
    "import flwr.serverapp, flwr.clientapp": ["-c", "import flwr.serverapp, flwr.clientapp"],
}
STOCK_RUNTIMES = ("hydrafl", "ray")


def run_process(
    argv: list[str], env: dict[str, str], log: Path, timeout_s: float = SCALE_TIMEOUT_S
) -> dict[str, Any]:
    """Wall time, CPU seconds (of the whole tree: the process and every descendant it waited for) and peak
    tree memory of one fresh process; the 1-minute load average before and after."""
    me = psutil.Process()
    cpu_before = _children_cpu_s()
    peak_rss = peak_private = peak_count = 0
    load_before = os.getloadavg()[0]
    with log.open("w") as log_file:
        started = time.perf_counter()
        process = subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        while process.poll() is None and time.perf_counter() - started < timeout_s:
            rss, private, count = tree_memory(me)
            peak_rss, peak_private, peak_count = (
                max(peak_rss, rss),
                max(peak_private, private),
                max(peak_count, count),
            )
            time.sleep(SAMPLE_S)
        timed_out = process.poll() is None
        if timed_out:
            process.kill()
            process.wait()
        wall_s = time.perf_counter() - started
    left_at_exit, terminated = reap_leftovers(me)
    cpu_s = _children_cpu_s() - cpu_before
    if process.returncode != 0 and not timed_out:
        raise RuntimeError(
            f"{' '.join(argv)} exited {process.returncode}; log tail:\n{log.read_text()[-3000:]}"
        )
    return {
        "wall_s": wall_s,
        "cpu_s": cpu_s,
        "timed_out": timed_out,
        "peak_rss_mb": peak_rss / MB,
        "peak_private_mb": peak_private / MB,
        "peak_processes": peak_count,
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "left_at_exit": left_at_exit,
        "terminated": terminated,
    }


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def scale_runs(sites: int, work: Path) -> dict[str, Any]:
    """Part 1: the three runs of `hydrafl simulate` on `sites` sites, and whether the worker runs agree."""
    from hydrafl.server.aggregation.checkpoint import load_checkpoint

    runs, arrays = {}, {}
    for label, extra in SCALE_RUNS.items():
        out = work / label.replace(" ", "-").replace(",", "")
        argv = [
            sys.executable,
            "-m",
            "hydrafl",
            "simulate",
            "--task",
            "tabular",
            "--sites",
            str(sites),
            "--fraction-train",
            "0.1",
            "--rounds",
            "3",
            "--strategies",
            "fedavg",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ]
        run = run_process(
            argv, {**os.environ, "RAY_AUTH_MODE": "disabled"}, work / f"{out.name}.log"
        )
        if not run["timed_out"]:
            history = json.loads((out / "results.json").read_text())["strategies"]["fedavg"][
                "rounds"
            ]
            run.update(
                final_loss=history[-1]["loss"],
                final_accuracy=history[-1]["accuracy"],
                history=[
                    {k: v for k, v in r.items() if k not in ("seconds", "aggregation_s", "gap_s")}
                    for r in history
                ],
            )
            checkpoint = load_checkpoint(out / "fedavg")
            assert checkpoint is not None  # the run just wrote it
            arrays[label] = checkpoint.arrays
        runs[label] = run
        print(
            f"{label}: {run['wall_s']:.1f} s (load {run['load_before']:.1f} -> {run['load_after']:.1f})",
            flush=True,
        )
    one, many = list(SCALE_RUNS)[:2]
    identical = (
        one in arrays
        and many in arrays
        and runs[one]["history"] == runs[many]["history"]
        and list(arrays[one]) == list(arrays[many])
        and all(
            arrays[one][name].numpy().tobytes() == arrays[many][name].numpy().tobytes()
            for name in arrays[one]
        )
    )
    return {
        "sites": sites,
        "runs": runs,
        "workers_identical": identical,
        "cores": len(os.sched_getaffinity(0)),
    }


def stock_runs(reps: int, work: Path) -> dict[str, Any]:
    """Part 2: the stock app through each runtime, and the floors, `reps` times in alternating order."""
    seconds: dict[str, list[float]] = {label: [] for label in (*STOCK_RUNTIMES, *FLOORS)}
    loads, losses = [], {}
    for rep in range(reps):
        for runtime in STOCK_RUNTIMES if rep % 2 == 0 else STOCK_RUNTIMES[::-1]:
            result = work / f"stock-{runtime}-{rep}.npz"
            env = {**os.environ, "STOCK_APP_RESULT": str(result), "RAY_AUTH_MODE": "disabled"}
            run = run_process(
                [sys.executable, "-m", "hydrafl.benchmarks._stock_worker", runtime],
                env,
                work / f"stock-{runtime}-{rep}.log",
                timeout_s=600,
            )
            seconds[runtime].append(run["wall_s"])
            loads.append(run["load_before"])
            losses[runtime] = float(np.load(result)["loss"])
        for label, argv in FLOORS.items():
            seconds[label].append(
                run_process([sys.executable, *argv], dict(os.environ), work / "floor.log")["wall_s"]
            )
    medians = {label: statistics.median(values) for label, values in seconds.items()}
    ratio = medians["ray"] / medians["hydrafl"]
    return {
        "reps": reps,
        "seconds": seconds,
        "median_s": medians,
        "ray_over_hydrafl": ratio,
        "goal": GOAL_STARTUP_RATIO,
        "goal_met": ratio >= GOAL_STARTUP_RATIO,
        "floor_ratio": medians["ray"] / medians["import flwr.serverapp, flwr.clientapp"],
        "final_loss": losses,
        "load_average": loads,
    }


def print_tables(summary: dict[str, Any]) -> None:
    console = Console()
    scale = summary["scale"]
    table = Table(
        title=f"hydrafl simulate, {scale['sites']} sites x 3 rounds (tabular, fedavg, fraction-train 0.1), "
        f"{scale['cores']} cores"
    )
    for column in (
        "run",
        "wall s",
        "CPU s",
        "peak RSS MB",
        "procs",
        "final loss",
        "load before/after",
    ):
        table.add_column(column, justify="left" if column == "run" else "right")
    for label, run in scale["runs"].items():
        wall = f"{run['wall_s']:.1f}" + (" (timed out)" if run["timed_out"] else "")
        table.add_row(
            label,
            wall,
            f"{run['cpu_s']:.0f}",
            f"{run['peak_rss_mb']:.0f}",
            str(run["peak_processes"]),
            f"{run.get('final_loss', float('nan')):.6f}",
            f"{run['load_before']:.1f}/{run['load_after']:.1f}",
        )
    console.print(table)
    fastest = min(run["wall_s"] for label, run in scale["runs"].items() if label != "ray")
    console.print(
        f"under {GOAL_SCALE_S:.0f} s: {verdict(fastest < GOAL_SCALE_S)}; 1 worker and 1 per core bit-identical: "
        f"{verdict(scale['workers_identical'], 'PASS', 'FAIL')}"
    )
    stock = summary["stock"]
    table = Table(title=f"10-site stock Flower app, whole process, median of {stock['reps']}")
    for column in ("process", "median s", "min s", "max s"):
        table.add_column(column, justify="left" if column == "process" else "right")
    for label, values in stock["seconds"].items():
        table.add_row(
            label, f"{stock['median_s'][label]:.2f}", f"{min(values):.2f}", f"{max(values):.2f}"
        )
    console.print(table)
    console.print(
        f"Flower + Ray / hydrafl: {stock['ray_over_hydrafl']:.1f}x, {verdict(stock['goal_met'])} (goal >= "
        f"{GOAL_STARTUP_RATIO:g}x); Ray / Flower's import floor: {stock['floor_ratio']:.1f}x"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    runs = summary["scale"]["runs"]
    labels = list(runs)
    axes[0].barh(
        range(len(labels)),
        [runs[label]["wall_s"] for label in labels],
        color=["tab:blue", "tab:green", "tab:orange"][: len(labels)],
    )
    axes[0].axvline(GOAL_SCALE_S, color="red", linestyle="--", label=f"goal {GOAL_SCALE_S:.0f} s")
    axes[0].set_yticks(range(len(labels)), labels)
    axes[0].set_xlabel("wall time of the whole process (s)")
    axes[0].set_title(f"{summary['scale']['sites']} sites x 3 rounds, fraction-train 0.1")
    axes[0].legend()
    stock = summary["stock"]
    labels = list(stock["seconds"])
    for i, label in enumerate(labels):
        axes[1].barh(
            i,
            stock["median_s"][label],
            color="tab:gray" if label in FLOORS else "tab:blue",
            alpha=0.7,
        )
        axes[1].scatter(
            stock["seconds"][label],
            [i] * len(stock["seconds"][label]),
            color="black",
            s=10,
            zorder=3,
        )
    axes[1].set_yticks(range(len(labels)), labels)
    axes[1].set_xscale("log")
    axes[1].set_xlabel("wall time of a fresh process (s, log scale)")
    axes[1].set_title(
        f"10-site stock app: Ray / hydrafl {stock['ray_over_hydrafl']:.1f}x (goal >= {GOAL_STARTUP_RATIO:g}x)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, "100 sites instead of 1,000, one repetition")
    parser.add_argument(
        "--reps", type=int, help="stock-app runs per runtime (default 5, 1 with --quick)"
    )
    parser.add_argument(
        "--sites", type=int, help="sites of part 1 (default 1000, 100 with --quick)"
    )
    args = parser.parse_args()
    become_subreaper()
    with tempfile.TemporaryDirectory(prefix="hydrafl-scale-") as work:
        scale = scale_runs(args.sites or (100 if args.quick else 1000), Path(work))
        stock = stock_runs(args.reps or (1 if args.quick else 5), Path(work))
    summary = {
        "benchmark": NAME,
        "quick": args.quick,
        "python": sys.version.split()[0],
        "scale": scale,
        "stock": stock,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
