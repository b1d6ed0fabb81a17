"""How long `hydrafl` takes to answer commands that need no model code: `--help` and `admin site list`.

    python -m hydrafl.benchmarks.cli_startup [--out DIR] [--quick]

Each command runs in a fresh interpreter (`python -m hydrafl ...`), so interpreter start and every import are
counted, as a user typing the command pays them. The baseline, measured in the same run on the same machine,
is `python -c "import torch, flwr.serverapp, matplotlib.pyplot"`: what the command line imported before it
parsed its arguments, whatever the command. An empty interpreter (`python -c pass`) shows the floor. Every
command runs once untimed (a warm page cache for all), then --reps times, the order rotating each repetition
so a busy shared machine slows them alike; times are medians of wall-clock seconds.
"""

from __future__ import annotations

import json
import os
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
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict

NAME = "cli_startup"
FULL_REPS = 10
QUICK_REPS = 3
BASELINE = "baseline: import torch, flwr, matplotlib"
HELP = "hydrafl --help"
SITE_LIST = "hydrafl admin site list"
EMPTY = "python -c pass"


def commands(db_url: str) -> dict[str, list[str]]:
    """Each measured command line, by the label the table and plot show."""
    hydrafl = [sys.executable, "-m", "hydrafl"]
    return {
        HELP: [*hydrafl, "--help"],
        SITE_LIST: [*hydrafl, "admin", "site", "list", "--db", db_url],
        BASELINE: [sys.executable, "-c", "import torch, flwr.serverapp, matplotlib.pyplot"],
        EMPTY: [sys.executable, "-c", "pass"],
    }


def wall_s(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit of `argv`; a failure is an error, not a fast time."""
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return seconds


def measure(reps: int, work: Path) -> dict[str, Any]:
    """Every command, warm-up first, then `reps` rotating rounds; the database holds one enrolled site."""
    env = {**os.environ, "HYDRAFL_HOME": str(work), "COLUMNS": "100"}
    db_url = f"sqlite:///{work / 'coordinator.db'}"
    subprocess.run(
        [sys.executable, "-m", "hydrafl", "admin", "site", "add", "st-marys", "--db", db_url],
        capture_output=True,
        env=env,
        check=True,
    )
    argvs = commands(db_url)
    labels = list(argvs)
    for label in labels:
        wall_s(argvs[label], env)
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    for rep in range(reps):
        for label in labels[rep % len(labels) :] + labels[: rep % len(labels)]:
            seconds[label].append(wall_s(argvs[label], env))
    return {
        label: {"argv": argvs[label][1:], "seconds": values, "median_s": statistics.median(values)}
        for label, values in seconds.items()
    }


def summarise(results: dict[str, Any], reps: int, quick: bool) -> dict[str, Any]:
    baseline = results[BASELINE]["median_s"]
    return {
        "benchmark": NAME,
        "quick": quick,
        "reps": reps,
        "python": sys.version.split()[0],
        "commands": results,
        "speedup_over_baseline": {
            label: baseline / results[label]["median_s"] for label in (HELP, SITE_LIST)
        },
        "help_faster_than_baseline": results[HELP]["median_s"] < baseline,
        "site_list_faster_than_baseline": results[SITE_LIST]["median_s"] < baseline,
    }


def print_table(summary: dict[str, Any]) -> None:
    commands_run = summary["commands"]
    baseline = commands_run[BASELINE]["median_s"]
    table = Table(
        title=f"wall time of a fresh process, median of {summary['reps']} (Python {summary['python']})"
    )
    for column in ("command", "median s", "min s", "max s", "vs baseline"):
        table.add_column(column, justify="left" if column == "command" else "right")
    for label, entry in commands_run.items():
        values = entry["seconds"]
        ratio = f"{baseline / entry['median_s']:.1f}x faster" if label in (HELP, SITE_LIST) else ""
        table.add_row(
            label, f"{entry['median_s']:.2f}", f"{min(values):.2f}", f"{max(values):.2f}", ratio
        )
    console = Console()
    console.print(table)
    console.print(
        f"`hydrafl --help` under the baseline: {verdict(summary['help_faster_than_baseline'])}; "
        f"`hydrafl admin site list` under it: {verdict(summary['site_list_faster_than_baseline'])}"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    labels = list(summary["commands"])
    colors = ["tab:green" if label in (HELP, SITE_LIST) else "tab:gray" for label in labels]
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, label in enumerate(labels):
        entry = summary["commands"][label]
        ax.barh(i, entry["median_s"], color=colors[i], alpha=0.7)
        ax.scatter(entry["seconds"], [i] * len(entry["seconds"]), color="black", s=10, zorder=3)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(f"wall time of a fresh process (s), median of {summary['reps']}")
    speedup = summary["speedup_over_baseline"][HELP]
    ax.set_title(
        f"hydrafl --help is {speedup:.1f}x faster than importing torch, flwr and matplotlib"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, f"{QUICK_REPS} repetitions instead of {FULL_REPS}")
    parser.add_argument("--reps", type=int, help="timed runs per command")
    args = parser.parse_args()
    reps = args.reps or (QUICK_REPS if args.quick else FULL_REPS)
    with tempfile.TemporaryDirectory(prefix="hydrafl-cli-") as work:
        results = measure(reps, Path(work))
    summary = summarise(results, reps, args.quick)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_table(summary)


if __name__ == "__main__":
    main()
