"""Cross-site duplicates with and without deduplication: accuracy and each site's sample weight.

    python -m hydrafl.benchmarks.dedup [--out DIR] [--quick] [--seeds N] [--tasks clinical-text tabular]

Hospitals share patients: site 0 (a referral centre) also holds copies of 20% of the other sites' training
records (`--duplicates 0.2`, half exact, half near copies: one word of a note or one measurement of a row
changed). Three conditions per task and seed, FedAvg, the same test splits:
- clean: no copies (the reference);
- duplicated: the copies, no deduplication: site 0's sample weight is inflated by its copies;
- deduplicated: the copies, and `--dedup` (keyed MinHash + LSH at the default threshold) before round 1.

Reported: final accuracy (federated evaluation on every site's test split; mean and standard deviation over
seeds), each site's share of the training weight (its records over all sites', as the sites report them after
the exchange), and how well the exchange finds the planted copies (recall and precision of the cross-site pairs
at the threshold). Goal: deduplication restores the clean weights (each site's share within 1 point of clean)
and finds the planted copies with recall and precision >= 0.95.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, progress_columns, verdict
from hydrafl.client.dedup import site_signatures
from hydrafl.client.site_app import run_cohort
from hydrafl.config import RunConfig
from hydrafl.server.dedup import NUM_PERM, SiteDedup, duplicate_pairs
from hydrafl.simulation.compare import run_strategy
from hydrafl.simulation.grid import FIRST_NODE_ID, simulated_dedup_key

NAME = "dedup"
DUPLICATES = 0.2
CONDITIONS = ("clean", "duplicated", "deduplicated")
GOAL_WEIGHT_POINTS = 1.0
GOAL_RECALL = GOAL_PRECISION = 0.95
FULL = {"sites": 4, "samples_per_site": 400, "rounds": 10, "local_steps": 10}
QUICK = {"sites": 3, "samples_per_site": 80, "rounds": 2, "local_steps": 2}
TASKS = ("clinical-text", "tabular")


def run_config(task: str, condition: str, seed: int, scale: dict[str, int]) -> RunConfig:
    return RunConfig(
        task=task,
        strategy="fedavg",
        seed=seed,
        duplicates=0.0 if condition == "clean" else DUPLICATES,
        dedup=condition == "deduplicated",
        sites=scale["sites"],
        samples_per_site=scale["samples_per_site"],
        rounds=scale["rounds"],
        local_steps=scale["local_steps"],
    )


def run_one(cfg: RunConfig) -> dict[str, Any]:
    """One run's final accuracy and each site's share of the training weight."""
    outcome: dict[int, SiteDedup] = {}
    history = run_strategy(cfg, "inprocess", on_dedup=outcome.update)
    records = [len(site.train_y) for site in run_cohort(cfg).sites]
    if outcome:
        records = [
            outcome[FIRST_NODE_ID + i].records - outcome[FIRST_NODE_ID + i].dropped
            for i in range(len(records))
        ]
    return {
        "accuracy": history[-1]["accuracy"],
        "records": records,
        "weights": [n / sum(records) for n in records],
    }


def detection(task: str, seed: int, scale: dict[str, int]) -> dict[str, float]:
    """Recall and precision of the cross-site pairs found against the planted ones, with the run's key."""
    cfg = run_config(task, "deduplicated", seed, scale)
    cohort = run_cohort(cfg)
    key = bytes.fromhex(simulated_dedup_key(seed))
    signatures = {
        i: site_signatures(site, cohort.task.modality, key, NUM_PERM)
        for i, site in enumerate(cohort.sites)
    }
    found = {frozenset(pair) for pair in duplicate_pairs(signatures, cfg.dedup_threshold)}
    planted = {frozenset({(s, row), (c, copy)}) for s, row, c, copy in cohort.planted}
    hits = len(found & planted)
    return {
        "planted": len(planted),
        "found": len(found),
        "recall": hits / len(planted),
        "precision": hits / len(found) if found else 1.0,
        "copies_share": len(planted) / sum(len(site.train_y) for site in cohort.sites),
    }


def summarise(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for task, conditions in runs.items():
        summary[task] = {}
        for condition, done in conditions.items():
            accuracies = [run["accuracy"] for run in done]
            sites = len(done[0]["weights"])
            summary[task][condition] = {
                "accuracy_mean": statistics.mean(accuracies),
                "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
                "weights": [
                    statistics.mean(run["weights"][i] for run in done) for i in range(sites)
                ],
                "records": [
                    statistics.mean(run["records"][i] for run in done) for i in range(sites)
                ],
            }
    return summary


def goals(summary: dict[str, Any], detected: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    out = {}
    for task, conditions in summary.items():
        gap = max(
            abs(a - b)
            for a, b in zip(
                conditions["deduplicated"]["weights"], conditions["clean"]["weights"], strict=True
            )
        )
        recall = min(d["recall"] for d in detected[task])
        precision = min(d["precision"] for d in detected[task])
        out[task] = {
            "max_weight_gap_points": 100 * gap,
            "min_recall": recall,
            "min_precision": precision,
            "met": 100 * gap <= GOAL_WEIGHT_POINTS
            and recall >= GOAL_RECALL
            and precision >= GOAL_PRECISION,
        }
    return out


def plot(summary: dict[str, Any], path: Path) -> None:
    tasks = list(summary)
    figure, axes = plt.subplots(2, len(tasks), figsize=(5.5 * len(tasks), 7), squeeze=False)
    width = 0.8 / len(CONDITIONS)
    for column, task in enumerate(tasks):
        weights_axis, accuracy_axis = axes[0][column], axes[1][column]
        for k, condition in enumerate(CONDITIONS):
            numbers = summary[task][condition]
            sites = range(len(numbers["weights"]))
            weights_axis.bar(
                [i + (k - 1) * width for i in sites],
                [100 * w for w in numbers["weights"]],
                width,
                label=condition,
            )
            accuracy_axis.bar(
                k,
                numbers["accuracy_mean"],
                yerr=numbers["accuracy_std"],
                capsize=4,
                label=condition,
            )
        weights_axis.set_xticks(range(len(summary[task]["clean"]["weights"])))
        weights_axis.set_title(f"{task}: share of the training weight")
        weights_axis.set_xlabel("site")
        weights_axis.set_ylabel("% of training records")
        weights_axis.legend()
        accuracy_axis.set_title(f"{task}: final accuracy")
        accuracy_axis.set_xticks(range(len(CONDITIONS)), CONDITIONS)
        low = min(summary[task][c]["accuracy_mean"] for c in CONDITIONS)
        accuracy_axis.set_ylim(max(0.0, low - 0.1), 1.0)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Cross-site duplicates with and without deduplication",
        "",
        f"FedAvg; site 0 also holds copies of {DUPLICATES:.0%} of the other sites' training records (half exact, "
        "half near copies); deduplication: keyed MinHash, "
        f"{NUM_PERM} permutations, LSH, threshold {RunConfig().dedup_threshold}. Accuracy: federated evaluation "
        "on every site's test split, mean +- std over seeds. Weight: a site's share of all training records.",
        "",
    ]
    for task, conditions in result["summary"].items():
        scale, sites = result["scale"], len(conditions["clean"]["weights"])
        lines += [
            f"## {task} ({scale['sites']} sites x {scale['samples_per_site']} records, {scale['rounds']} rounds x "
            f"{scale['local_steps']} local steps, {result['seeds']} seed(s))",
            "",
            "| condition | accuracy | "
            + " | ".join(f"site {i} weight (records)" for i in range(sites))
            + " |",
            "|---|---|" + "---|" * sites,
        ]
        for condition, numbers in conditions.items():
            cells = [
                f"{100 * w:.1f}% ({n:.0f})"
                for w, n in zip(numbers["weights"], numbers["records"], strict=True)
            ]
            lines.append(
                f"| {condition} | {numbers['accuracy_mean']:.3f} +- {numbers['accuracy_std']:.3f} | "
                + " | ".join(cells)
                + " |"
            )
        detected = result["detection"][task]
        goal = result["goals"][task]
        lines += [
            "",
            f"Copies: {statistics.mean(d['copies_share'] for d in detected):.1%} of all training records. "
            f"Planted pairs found: recall {statistics.mean(d['recall'] for d in detected):.3f}, precision "
            f"{statistics.mean(d['precision'] for d in detected):.3f} (mean over seeds; worst seed "
            f"{goal['min_recall']:.3f} / {goal['min_precision']:.3f}). Deduplicated weights within "
            f"{goal['max_weight_gap_points']:.2f} points of clean: "
            f"{'goal met' if goal['met'] else 'BELOW GOAL'}.",
            "",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = benchmark_parser(__doc__, "3 sites x 80 records, 2 rounds, tabular, one seed")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    args = parser.parse_args()
    scale, seeds = (QUICK, 1) if args.quick else (FULL, args.seeds)
    tasks = ["tabular"] if args.quick else args.tasks
    jobs = [(t, c, s) for t in tasks for s in range(seeds) for c in CONDITIONS]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    logging.getLogger("flwr").setLevel(logging.WARNING)
    with Progress(*progress_columns()) as progress:
        bar = progress.add_task("dedup runs", total=len(jobs))
        for task, condition, seed in jobs:
            progress.update(bar, description=f"{task} {condition} seed {seed}")
            done = run_one(run_config(task, condition, seed, scale))
            runs.setdefault(task, {}).setdefault(condition, []).append({"seed": seed, **done})
            progress.advance(bar)
    detected = {task: [detection(task, seed, scale) for seed in range(seeds)] for task in tasks}
    summary = summarise(runs)
    result = {
        "summary": summary,
        "goals": goals(summary, detected),
        "detection": detected,
        "scale": scale,
        "seeds": seeds,
        "duplicates": DUPLICATES,
        "quick": args.quick,
        "runs": runs,
    }
    write_results(args.out, result)
    print_summary(result)


def write_results(out: Path, result: dict[str, Any]) -> None:
    """dedup.json, dedup.md and dedup.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{NAME}.json").write_text(json.dumps(result, indent=1))
    (out / f"{NAME}.md").write_text(markdown(result))
    plot(result["summary"], out / f"{NAME}.png")


def print_summary(result: dict[str, Any]) -> None:
    console = Console()
    for task, conditions in result["summary"].items():
        table = Table(
            title=f"{task}: {DUPLICATES:.0%} of the other sites' records copied to site 0"
        )
        for column in ("condition", "accuracy", "site weights (%)"):
            table.add_column(column)
        for condition, numbers in conditions.items():
            table.add_row(
                condition,
                f"{numbers['accuracy_mean']:.3f} +- {numbers['accuracy_std']:.3f}",
                ", ".join(f"{100 * w:.1f}" for w in numbers["weights"]),
            )
        console.print(table)
        goal = result["goals"][task]
        console.print(
            f"{task}: deduplicated weights within {goal['max_weight_gap_points']:.2f} points of clean, recall "
            f"{goal['min_recall']:.3f}, precision {goal['min_precision']:.3f}: {verdict(goal['met'])}"
        )


if __name__ == "__main__":
    main()
