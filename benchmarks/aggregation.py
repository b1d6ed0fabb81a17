"""hydrafl's streaming accumulator against the memory-bandwidth limit: in-place torch adds of the same bytes.

    python -m hydrafl.benchmarks.aggregation [--out DIR] [--quick]

Throughput: SITES replies (one ArrayRecord of ARRAYS_PER_MODEL float32 arrays, one MetricRecord with
num-examples, unequal weights) already in memory. Every aggregator takes the same replies, in a rotating order
within each repetition, in three settings: torch on 1 thread, on 2, and on 2 while a background process spins
on one core ("busy"). The baselines are what the memory bus allows: a preallocated float32 sum and
`sum.add_(x, alpha=w)` over the replies' tensors, already parsed (torch's own threads, the setting's count);
for the masked sums, `sum.addcmul_(mask, x, value=w); count.add_(mask, alpha=w)` with the masks already
float32. hydrafl: `WeightedDeltaAccumulator.add_all` of the list, then `mean()`; the same with `add` per reply
("one by one", as a coordinator streaming replies folds them); `MaskedDeltaAccumulator.add` per reply with bool
masks, then `mean()`. Flower: `FedAvg.aggregate_train`. A ratio is the baseline's seconds over the
aggregator's in the same repetition (paired, so the shared machine's load drifts out), median over
repetitions; goal >= 0.85 for hydrafl and hydrafl masked in every setting. `uptime`'s load is recorded
before and after.

Memory: replies built one by one as they are iterated (as they arrive); each aggregator runs alone in a fresh
process (`_aggregation_worker`) that reports its peak RSS, less a baseline process that only imports and
builds one reply and its masks: "extra" is what aggregating costs beyond that, in models. Goal: hydrafl's
extra under 3 models at every size (Flower's FedAvg collects every reply, so it grows with the sites).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from flwr.app import Message
from rich.console import Console
from rich.table import Table

from hydrafl.arrays import array_view, from_record
from hydrafl.benchmarks._aggregation_worker import (
    ARRAYS_PER_MODEL,
    MASKED_FRACTION,
    PROBES,
    flower_aggregate,
    hydrafl_aggregate,
    hydrafl_masked,
    hydrafl_one_by_one,
    make_masks,
    make_reply,
    num_examples,
)
from hydrafl.benchmarks._common import benchmark_parser, verdict

NAME = "aggregation"
GOAL_RATIO = 0.85
GOAL_EXTRA_MODELS = 3.0
TOLERANCE = 1e-5
MB = 1e6  # decimal megabytes: one 10M-parameter fp32 model is 40 MB
SETTINGS = {
    "1 thread": (1, False),
    "2 threads": (2, False),
    "2 threads, other core busy": (2, True),
}
BASELINE_OF = {
    "hydrafl": "torch adds",
    "hydrafl one by one": "torch adds",
    "flower": "torch adds",
    "hydrafl masked": "torch masked adds",
}
GOALS = ("hydrafl", "hydrafl masked")


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    params: int
    sites: int
    memory_sites: tuple[int, ...]
    reps: int
    memory_reps: int

    @property
    def model_bytes(self) -> int:
        return self.params * 4


FULL = Scale(params=10_000_000, sites=10, memory_sites=(10, 50, 100), reps=9, memory_reps=1)
QUICK = Scale(params=1_000_000, sites=4, memory_sites=(2, 4), reps=3, memory_reps=1)


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """The replies, and the same data as the baselines take it: parsed tensors, float masks, weights."""

    replies: list[Message]
    tensors: list[list[torch.Tensor]]
    masks: list[dict[str, torch.Tensor]]
    float_masks: list[list[torch.Tensor]]
    weights: list[float]

    @classmethod
    def build(cls, scale: Scale) -> Workload:
        replies = [make_reply(site, scale.params) for site in range(scale.sites)]
        masks = [make_masks(site, scale.params) for site in range(scale.sites)]
        return cls(
            replies=replies,
            tensors=[
                [
                    torch.from_numpy(array_view(a))
                    for a in reply.content.array_records["arrays"].values()
                ]
                for reply in replies
            ],
            masks=masks,
            float_masks=[[mask.float() for mask in site.values()] for site in masks],
            weights=[float(num_examples(site)) for site in range(scale.sites)],
        )


def torch_adds(work: Workload, sums: list[torch.Tensor]) -> None:
    """The baseline: in-place adds into preallocated sums (torch's threads, the setting's count)."""
    for tensors, weight in zip(work.tensors, work.weights, strict=True):
        for total, values in zip(sums, tensors, strict=True):
            total.add_(values, alpha=weight)


def torch_masked_adds(work: Workload, sums: list[torch.Tensor], counts: list[torch.Tensor]) -> None:
    for tensors, masks, weight in zip(work.tensors, work.float_masks, work.weights, strict=True):
        for total, count, values, mask in zip(sums, counts, tensors, masks, strict=True):
            total.addcmul_(mask, values, value=weight)
            count.add_(mask, alpha=weight)


def aggregators(work: Workload, threads: int) -> dict[str, Callable[[], Any]]:
    """Each timed call: what it does and nothing else (the baselines' sums are zeroed, not allocated, outside)."""
    shapes = [tensor.shape for tensor in work.tensors[0]]
    sums, counts = (
        [torch.zeros(shape) for shape in shapes],
        [torch.zeros(shape) for shape in shapes],
    )
    return {
        "torch adds": lambda: torch_adds(work, sums),
        "torch masked adds": lambda: torch_masked_adds(work, sums, counts),
        "hydrafl": lambda: hydrafl_aggregate(work.replies, threads),
        "hydrafl one by one": lambda: hydrafl_one_by_one(work.replies, threads),
        "hydrafl masked": lambda: hydrafl_masked(work.replies, threads, work.masks),
        "flower": lambda: flower_aggregate(work.replies, threads),
    }


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def timed_setting(work: Workload, scale: Scale, threads: int, busy: bool) -> dict[str, Any]:
    """Every aggregator `reps` times, rotating the order; paired ratios to the baselines."""
    torch.set_num_threads(threads)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        calls = aggregators(work, threads)
        seconds: dict[str, list[float]] = {name: [] for name in calls}
        names = list(calls)
        for rep in range(scale.reps):
            for name in names[rep % len(names) :] + names[: rep % len(names)]:
                gc.collect()
                started = time.perf_counter()
                calls[name]()
                seconds[name].append(time.perf_counter() - started)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    input_bytes = scale.sites * scale.model_bytes
    ratios = {
        name: statistics.median(
            b / s for b, s in zip(seconds[baseline], seconds[name], strict=True)
        )
        for name, baseline in BASELINE_OF.items()
    }
    return {
        "threads": threads,
        "busy": busy,
        "seconds": seconds,
        "median_s": {name: statistics.median(times) for name, times in seconds.items()},
        "gb_per_s": {
            name: input_bytes / statistics.median(times) / 1e9 for name, times in seconds.items()
        },
        "ratio_vs_baseline": ratios,
        "goal_met": {name: ratios[name] >= GOAL_RATIO for name in GOALS},
    }


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


def equality(work: Workload) -> dict[str, Any]:
    """hydrafl's means against float64 references; thread counts and grouping against each other, bitwise."""
    names = list(work.replies[0].content["arrays"])
    total_weight = sum(work.weights)
    weighted = {
        name: sum(w * t[i].double() for t, w in zip(work.tensors, work.weights, strict=True))
        / total_weight
        for i, name in enumerate(names)
    }
    masked = {}
    for i, name in enumerate(names):
        counts = sum(w * m[i].double() for m, w in zip(work.float_masks, work.weights, strict=True))
        sums = sum(
            w * m[i].double() * t[i].double()
            for t, m, w in zip(work.tensors, work.float_masks, work.weights, strict=True)
        )
        masked[name] = torch.where(counts > 0, sums / counts.clamp(min=1e-30), 0.0)
    one, two = hydrafl_aggregate(work.replies, 1), hydrafl_aggregate(work.replies, 2)
    streamed = hydrafl_one_by_one(work.replies, 2)
    masked_one, masked_two = (
        hydrafl_masked(work.replies, 1, work.masks),
        hydrafl_masked(work.replies, 2, work.masks),
    )
    flower = from_record(flower_aggregate(work.replies))
    diffs = {
        "hydrafl": max_abs_diff({n: t.double() for n, t in one.items()}, weighted),
        "hydrafl masked": max_abs_diff({n: m.double() for n, (m, _) in masked_one.items()}, masked),
        "flower": max_abs_diff({n: t.double() for n, t in flower.items()}, weighted),
    }
    identical = {
        "1 vs 2 threads": all(torch.equal(one[n], two[n]) for n in names),
        "grouped vs one by one": all(torch.equal(one[n], streamed[n]) for n in names),
        "masked 1 vs 2 threads": all(
            torch.equal(masked_one[n][0], masked_two[n][0]) for n in names
        ),
    }
    return {
        "max_abs_diff_vs_float64": diffs,
        "tolerance": TOLERANCE,
        "bit_identical": identical,
        "passed": max(diffs.values()) <= TOLERANCE and all(identical.values()),
    }


def probe(what: str, sites: int, scale: Scale) -> int:
    """Peak RSS (bytes) of a fresh process running `what` over `sites` lazily built replies."""
    command = [sys.executable, "-m", "hydrafl.benchmarks._aggregation_worker", what]
    done = subprocess.run(
        [*command, "--sites", str(sites), "--params", str(scale.params)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"memory probe {what} ({sites} sites) failed:\n{done.stderr[-3000:]}")
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def memory(scale: Scale) -> dict[str, Any]:
    """Extra peak memory of each aggregator over the baseline, as the number of sites grows. Probes run two at
    a time: each reports its own peak, which another process running beside it does not change."""
    measured = [name for name in PROBES if name != "baseline"]
    jobs = [("baseline", 1)] + [(name, count) for count in scale.memory_sites for name in measured]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {
            job: [pool.submit(probe, *job, scale) for _ in range(scale.memory_reps)] for job in jobs
        }
        peaks = {
            job: statistics.median(future.result() for future in done)
            for job, done in futures.items()
        }
    baseline = peaks["baseline", 1]
    sites = {
        str(count): {
            name: {
                "peak_mb": peaks[name, count] / MB,
                "extra_mb": (peaks[name, count] - baseline) / MB,
                "extra_models": (peaks[name, count] - baseline) / scale.model_bytes,
            }
            for name in measured
        }
        for count in scale.memory_sites
    }
    worst = {
        name: max(entry[name]["extra_models"] for entry in sites.values()) for name in measured
    }
    return {
        "baseline_mb": baseline / MB,
        "model_mb": scale.model_bytes / MB,
        "sites": sites,
        "goal_extra_models": GOAL_EXTRA_MODELS,
        "worst_extra_models": worst,
        "goal_met": {name: worst[name] < GOAL_EXTRA_MODELS for name in GOALS},
    }


def print_tables(summary: dict[str, Any]) -> None:
    config, mem = summary["config"], summary["memory"]
    console = Console()
    table = Table(
        title=f"{config['sites']} sites x {config['params'] / 1e6:g}M fp32 ({config['input_mb']:.0f} MB of replies), "
        f"median of {config['reps']}; ratio = baseline s / aggregator s, paired per repetition (goal >= {GOAL_RATIO})"
    )
    table.add_column("aggregator")
    for setting in SETTINGS:
        table.add_column(f"{setting}\nGB/s", justify="right")
        table.add_column("ratio", justify="right")
    for name in summary["throughput"]["1 thread"]["median_s"]:
        row = [name]
        for setting in SETTINGS:
            result = summary["throughput"][setting]
            ratio = result["ratio_vs_baseline"].get(name)
            text = "baseline" if ratio is None else f"{ratio:.2f}"
            if name in GOALS:
                text = verdict(result["goal_met"][name], text, f"{text} BELOW GOAL")
            row += [f"{result['gb_per_s'][name]:.2f}", text]
        table.add_row(*row)
    console.print(table)
    console.print(f"load: {config['load_before']} -> {config['load_after']}")
    check = summary["equality"]
    console.print(
        "max |diff| to float64 references: "
        + ", ".join(f"{name} {diff:.1e}" for name, diff in check["max_abs_diff_vs_float64"].items())
        + f" (tolerance {TOLERANCE:g}); bit-identical: "
        + ", ".join(f"{name} {ok}" for name, ok in check["bit_identical"].items())
        + f": {verdict(check['passed'], 'PASS', 'FAIL')}"
    )
    table = Table(
        title=f"extra peak memory over baseline ({mem['baseline_mb']:.0f} MB: imports + one reply and its masks), "
        f"in models of {mem['model_mb']:.0f} MB (goal < {GOAL_EXTRA_MODELS:g} for hydrafl)"
    )
    names = list(mem["worst_extra_models"])
    for column in (
        "sites",
        *(f"{name} MB" for name in names),
        *(f"{name} models" for name in names),
    ):
        table.add_column(column, justify="right")
    for count, entry in mem["sites"].items():
        table.add_row(
            count,
            *(f"{entry[n]['extra_mb']:.0f}" for n in names),
            *(f"{entry[n]['extra_models']:.1f}" for n in names),
        )
    console.print(table)
    console.print(
        ", ".join(
            f"{name} under {GOAL_EXTRA_MODELS:g} models: {verdict(ok)}"
            for name, ok in mem["goal_met"].items()
        )
    )


def plot(summary: dict[str, Any], path: Path) -> None:
    mem = summary["memory"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = list(summary["throughput"]["1 thread"]["median_s"])
    width = 0.8 / len(SETTINGS)
    for i, setting in enumerate(SETTINGS):
        rates = [summary["throughput"][setting]["gb_per_s"][name] for name in names]
        left.bar(np.arange(len(names)) + i * width, rates, width, label=setting)
    left.set_xticks(np.arange(len(names)) + width, names, rotation=20, ha="right")
    left.set_ylabel("GB/s of replies")
    left.set_title(
        f"{summary['config']['sites']} sites x {summary['config']['params'] / 1e6:g}M fp32"
    )
    left.legend(fontsize=8)
    counts = [int(count) for count in mem["sites"]]
    for name in mem["worst_extra_models"]:
        right.plot(
            counts,
            [mem["sites"][str(c)][name]["extra_models"] for c in counts],
            marker="o",
            label=name,
        )
    right.axhline(
        GOAL_EXTRA_MODELS, color="gray", linestyle=":", label=f"goal: {GOAL_EXTRA_MODELS:g} models"
    )
    right.set_xlabel("sites")
    right.set_ylabel(f"extra peak memory (models of {mem['model_mb']:.0f} MB)")
    right.set_title("peak memory beyond imports + one reply")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    args.out.mkdir(parents=True, exist_ok=True)
    logging.getLogger("flwr").setLevel(logging.WARNING)  # FedAvg logs every aggregation at INFO
    config = {
        "params": scale.params,
        "arrays_per_model": ARRAYS_PER_MODEL,
        "model_mb": scale.model_bytes / MB,
        "sites": scale.sites,
        "input_mb": scale.sites * scale.model_bytes / MB,
        "masked_fraction": MASKED_FRACTION,
        "reps": scale.reps,
        "memory_reps": scale.memory_reps,
        "cores": len(os.sched_getaffinity(0)),
        "load_before": load(),
    }
    with (
        warnings.catch_warnings()
    ):  # the baselines' tensors are read-only views of the replies, as hydrafl's
        warnings.simplefilter("ignore", UserWarning)
        work = Workload.build(scale)
    throughput = {setting: timed_setting(work, scale, *how) for setting, how in SETTINGS.items()}
    config["load_after"] = load()
    summary = {
        "benchmark": NAME,
        "quick": args.quick,
        "config": config,
        "throughput": throughput,
        "equality": equality(work),
    }
    del work
    summary["memory"] = memory(scale)
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
