"""hydrafl's streaming weighted mean vs Flower's FedAvg.aggregate_train: throughput, equality, peak memory.

    python -m hydrafl.benchmarks.aggregation [--out DIR] [--quick]

Throughput: both aggregators take the same list of real Flower reply Messages (one ArrayRecord of
ARRAYS_PER_MODEL float32 arrays, one MetricRecord with num-examples, unequal weights), alternating which one
runs first; both return an ArrayRecord. Torch runs one thread: numpy's element-wise ops are single-threaded,
and one thread compares the two algorithms rather than the thread counts of a shared 2-core machine.

Memory: the replies come from a generator that builds each one when it is iterated, as replies arriving one
by one; an aggregator that streams need not hold them all, one that collects them (FedAvg makes a list) must.
Each aggregator runs alone in a fresh process (`_aggregation_worker`) that reports its peak RSS; a baseline
process that only imports and builds one reply is subtracted, so "extra" is what aggregating costs beyond
the one model-sized reply any aggregator must hold, in multiples of one model.

Goals: throughput ratio >= 3x; hydrafl's extra memory flat in the number of sites and under
3 models, while Flower's grows.
"""

from __future__ import annotations

import gc
import json
import logging
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser, verdict  # noqa: E402
from hydrafl.benchmarks._aggregation_worker import AGGREGATORS, ARRAYS_PER_MODEL, lazy_replies  # noqa: E402

NAME = "aggregation"
GOAL_THROUGHPUT_RATIO = 3.0
GOAL_EXTRA_MODELS = 3.0
TOLERANCE = 1e-5
MB = 1e6  # decimal megabytes: one 10M-parameter fp32 model is 40 MB


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    params: int
    throughput_sites: int
    memory_sites: tuple[int, ...]
    reps: int
    memory_reps: int

    @property
    def model_bytes(self) -> int:
        return self.params * 4


FULL = Scale(params=10_000_000, throughput_sites=10, memory_sites=(10, 20, 50), reps=7, memory_reps=3)
QUICK = Scale(params=1_000_000, throughput_sites=4, memory_sites=(2, 4), reps=3, memory_reps=1)


def max_abs_diff(a: ArrayRecord, b: ArrayRecord) -> float:
    if set(a) != set(b):
        return float("inf")
    return max(float(np.max(np.abs(a[name].numpy() - b[name].numpy()))) for name in a)


def throughput(scale: Scale) -> dict[str, Any]:
    """Time both aggregators on the same resident replies; check they agree."""
    replies = list(lazy_replies(scale.throughput_sites, scale.params))
    seconds: dict[str, list[float]] = {name: [] for name in AGGREGATORS}
    results: dict[str, ArrayRecord] = {}
    for rep in range(scale.reps):
        for name in AGGREGATORS if rep % 2 == 0 else list(AGGREGATORS)[::-1]:
            gc.collect()
            started = time.perf_counter()
            result = AGGREGATORS[name](iter(replies))
            seconds[name].append(time.perf_counter() - started)
            results.setdefault(name, result)
            del result
    input_bytes = scale.throughput_sites * scale.model_bytes
    medians = {name: statistics.median(times) for name, times in seconds.items()}
    ratio = medians["flower"] / medians["hydrafl"]
    diff = max_abs_diff(results["hydrafl"], results["flower"])
    return {
        "sites": scale.throughput_sites,
        "input_mb": input_bytes / MB,
        "seconds": seconds,
        "median_s": medians,
        "gb_per_s": {name: input_bytes / median / 1e9 for name, median in medians.items()},
        "speedup_hydrafl_over_flower": ratio,  # Flower's median seconds / hydrafl's
        "goal": GOAL_THROUGHPUT_RATIO,
        "goal_met": ratio >= GOAL_THROUGHPUT_RATIO,
        "equality": {"max_abs_diff": diff, "tolerance": TOLERANCE, "passed": diff <= TOLERANCE},
    }


def probe(what: str, sites: int, scale: Scale) -> int:
    """Peak RSS (bytes) of a fresh process running `what` over `sites` lazily built replies."""
    command = [sys.executable, "-m", "hydrafl.benchmarks._aggregation_worker", what]
    done = subprocess.run(
        [*command, "--sites", str(sites), "--params", str(scale.params)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {what} ({sites} sites) failed:\n{done.stderr[-3000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def memory(scale: Scale) -> dict[str, Any]:
    """Extra peak memory of each aggregator over the baseline, as the number of sites grows. Probes run two at
    a time: each reports its own peak, which another process running beside it does not change."""
    jobs = [("baseline", 1)] + [(name, count) for count in scale.memory_sites for name in AGGREGATORS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {job: [pool.submit(probe, *job, scale) for _ in range(scale.memory_reps)] for job in jobs}
        peaks = {job: statistics.median(future.result() for future in done) for job, done in futures.items()}
    baseline = peaks["baseline", 1]
    sites = {
        str(count): {
            name: {
                "peak_mb": peaks[name, count] / MB,
                "extra_mb": (peaks[name, count] - baseline) / MB,
                "extra_models": (peaks[name, count] - baseline) / scale.model_bytes,
            }
            for name in AGGREGATORS
        }
        for count in scale.memory_sites
    }
    hydrafl = [entry["hydrafl"]["extra_models"] for entry in sites.values()]
    flower = [entry["flower"]["extra_models"] for entry in sites.values()]
    return {
        "baseline_mb": baseline / MB,
        "model_mb": scale.model_bytes / MB,
        "sites": sites,
        "goal_extra_models": GOAL_EXTRA_MODELS,
        "hydrafl_under_goal": max(hydrafl) < GOAL_EXTRA_MODELS,
        "hydrafl_spread_models": max(hydrafl) - min(hydrafl),
        "flower_growth_models": flower[-1] - flower[0],
    }


def print_tables(summary: dict[str, Any]) -> None:
    tput, mem, config = summary["throughput"], summary["memory"], summary["config"]
    console = Console()
    table = Table(
        title=f"{tput['sites']} sites x {config['params'] / 1e6:g}M fp32 ({tput['input_mb']:.0f} MB of replies), "
        f"median of {config['reps']}"
    )
    for column in ("aggregator", "median s", "GB/s", "runs s"):
        table.add_column(column, justify="right")
    for name in AGGREGATORS:
        runs = " ".join(f"{s:.3f}" for s in tput["seconds"][name])
        table.add_row(name, f"{tput['median_s'][name]:.3f}", f"{tput['gb_per_s'][name]:.2f}", runs)
    console.print(table)
    ratio = tput["speedup_hydrafl_over_flower"]
    equality = tput["equality"]
    console.print(
        f"hydrafl speed-up over Flower {ratio:.2f}x: {verdict(tput['goal_met'])} (goal >= {GOAL_THROUGHPUT_RATIO:g}x); "
        f"same mean: max |diff| {equality['max_abs_diff']:.2e} (tolerance {TOLERANCE:g}): "
        f"{verdict(equality['passed'], 'PASS', 'FAIL')}"
    )
    table = Table(
        title=f"extra peak memory over baseline ({mem['baseline_mb']:.0f} MB: imports + one reply), "
        f"in models of {mem['model_mb']:.0f} MB"
    )
    for column in ("sites", *(f"{name} MB" for name in AGGREGATORS), *(f"{name} models" for name in AGGREGATORS)):
        table.add_column(column, justify="right")
    for count, entry in mem["sites"].items():
        table.add_row(
            count,
            *(f"{entry[name]['extra_mb']:.0f}" for name in AGGREGATORS),
            *(f"{entry[name]['extra_models']:.1f}" for name in AGGREGATORS),
        )
    console.print(table)
    console.print(
        f"hydrafl under {GOAL_EXTRA_MODELS:g} models at every size: {verdict(mem['hydrafl_under_goal'])}; "
        f"hydrafl spread {mem['hydrafl_spread_models']:.1f} models, "
        f"Flower grows {mem['flower_growth_models']:.1f} models"
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    tput, mem = summary["throughput"], summary["memory"]
    colors = {"hydrafl": "tab:blue", "flower": "tab:orange"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, name in enumerate(AGGREGATORS):
        left.bar(i, tput["gb_per_s"][name], color=colors[name], alpha=0.7)
    left.set_xticks(range(len(AGGREGATORS)), list(AGGREGATORS))
    left.set_ylabel("aggregation throughput (GB/s of replies)")
    left.set_title(f"{tput['sites']} sites: hydrafl {tput['speedup_hydrafl_over_flower']:.2f}x Flower (goal >= 3x)")
    counts = [int(count) for count in mem["sites"]]
    for name in AGGREGATORS:
        extra = [mem["sites"][str(count)][name]["extra_models"] for count in counts]
        right.plot(counts, extra, marker="o", label=name, color=colors[name])
    right.axhline(GOAL_EXTRA_MODELS, color="gray", linestyle=":", label=f"goal: {GOAL_EXTRA_MODELS:g} models")
    right.set_xlabel("sites")
    right.set_ylabel(f"extra peak memory (models of {mem['model_mb']:.0f} MB)")
    right.set_title("peak memory beyond imports + one reply")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # FedAvg logs every aggregation at INFO
    summary = {
        "benchmark": NAME,
        "quick": args.quick,
        "config": {
            "params": scale.params,
            "arrays_per_model": ARRAYS_PER_MODEL,
            "model_mb": scale.model_bytes / MB,
            "reps": scale.reps,
            "memory_reps": scale.memory_reps,
            "torch_threads": torch.get_num_threads(),
        },
        "throughput": throughput(scale),
    }
    summary["memory"] = memory(scale)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
