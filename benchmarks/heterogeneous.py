"""Hydra vs the model-heterogeneous baselines at equal per-site budgets, over several seeds.

    python -m hydrafl.benchmarks.heterogeneous [--out DIR] [--quick] [--seeds N] [--first-seed K] [--groups ...]

Non-IID hospitals (the clinical-text cohort: per-site label prevalence and writing style) with three resource
tiers (small, medium, large, cycling over the sites). Every heterogeneous method gives a site of a tier the
same budget in trainable parameters (Hydra's layers x heads for the tier; the width baselines pick the width,
the LoRA baselines the rank, that comes closest), and every method runs the same seeds, data and rounds.

Groups, each on the coordinates its methods share:
- full (tiny BERT from scratch): FedAvg (every site trains everything), Hydra, HeteroFL, FjORD, FedRolex;
- lora (the same model with rank-8 LoRA on the attention projections, head trained too): FedIT, Hydra,
  FLoRA, HetLoRA, FlexLoRA;
- minilm-full / minilm-lora (the pretrained MiniLM-L6 encoder, `hydrafl[minilm]`): full-model FedAvg against
  Hydra and the LoRA baselines over LoRA, at a smaller scale (full fine-tuning MiniLM costs seconds per step on
  a CPU).

Reported per method: final accuracy (mean and standard deviation over seeds), bytes per round (up + down, all
sites), per-tier trainable parameters (as the strategy assigned them) and per-tier peak training memory (as the
sites measured it, `hydrafl.footprint`). Goals: Hydra at or above the best heterogeneous
baseline of its group; Hydra over LoRA at >= 10x fewer bytes per round than full-model FedAvg within 1 accuracy
point of it (on MiniLM, where LoRA starts from pretrained features). Since the spread over seeds is about the
size of the gaps between methods, Hydra's gap to the best baseline is also given paired by seed (mean and
standard error of the per-seed differences).

Runs merge into an existing results file of the same mode (full or `--quick`; one of the other mode is
replaced) in `--out`: a group run again with the same scale keeps its other seeds (a seed run again is
replaced), and groups not run stay. So seeds can be added later, or split over processes (each site runs on
one core): `--seeds 3` in one, `--first-seed 3 --seeds 2` in another; each merges what is in the file when it
finishes, so let them finish at different times.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser, verdict
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation.grid import FIRST_NODE_ID
from hydrafl.simulation_config import SimulationConfig

NAME = "heterogeneous"
TIERS = ("small", "medium", "large")
LORA_RANK = 8
GOAL_BYTES_RATIO = 10.0
GOAL_ACCURACY_POINTS = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    rounds: int
    local_steps: int
    seeds: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Methods compared on the same coordinates: the model, LoRA or not, and a scale that fits a CPU."""

    strategies: tuple[str, ...]
    model: str = "tiny"
    lora_rank: int = 0
    lr: float = field(default_factory=lambda: RunConfig().lr)
    full: Scale
    quick: Scale
    overrides: tuple[tuple[str, Any], ...] = ()
    """RunConfig settings beyond the common ones (`budgets.py`: memory limits, a deadline, no tiers)."""
    variants: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    """Hydra with other knobs, each reported as a method of its own and paired with plain Hydra by seed:
    (label, knobs), e.g. ("hydra-rescore", (("rescore_every", 1),)) (`budgets.py`)."""


TINY_FULL, TINY_QUICK = (
    Scale(sites=6, rounds=12, local_steps=10, seeds=3),
    Scale(sites=3, rounds=2, local_steps=2, seeds=1),
)
# 6 rounds x 8 local steps for both groups: at 4 x 5 LoRA was still climbing; this is what a 2-core CPU affords
MINILM_FULL, MINILM_QUICK = (
    Scale(sites=3, rounds=6, local_steps=8, seeds=3),
    Scale(sites=3, rounds=1, local_steps=1, seeds=1),
)
GROUPS = {
    "full": Group(
        strategies=("fedavg", "hydra", "heterofl", "fjord", "fedrolex"),
        full=TINY_FULL,
        quick=TINY_QUICK,
    ),
    "lora": Group(
        strategies=("fedit", "hydra", "flora", "hetlora", "flexlora"),
        lora_rank=LORA_RANK,
        full=TINY_FULL,
        quick=TINY_QUICK,
    ),
    # the bytes-vs-accuracy goal: pretrained MiniLM, full-model FedAvg against Hydra over LoRA
    # learning rates: 1e-4 for full fine-tuning of a pretrained encoder (the usual recipe); 5e-3 for LoRA, chosen
    # by a 1-seed check of Hydra at MINILM_FULL (seed 0, final accuracy: 2e-3 0.69, 5e-3 0.79, 1e-2 diverged to
    # the majority class 0.35; full FedAvg at 1e-4 reached 0.83 there)
    "minilm-full": Group(
        strategies=("fedavg",), model="minilm", lr=1e-4, full=MINILM_FULL, quick=MINILM_QUICK
    ),
    "minilm-lora": Group(
        strategies=("hydra", "fedit", "flora", "hetlora", "flexlora"),
        model="minilm",
        lora_rank=LORA_RANK,
        lr=5e-3,
        full=MINILM_FULL,
        quick=MINILM_QUICK,
    ),
}
BYTES_GOAL = (("minilm-full", "fedavg"), ("minilm-lora", "hydra"))
"""(reference, method) of the goal: >= 10x fewer bytes per round than full-model FedAvg within 1 point."""


def run_config(group: Group, scale: Scale, seed: int) -> RunConfig:
    config = RunConfig(
        task="clinical-text",
        model=group.model,
        sites=scale.sites,
        rounds=scale.rounds,
        local_steps=scale.local_steps,
        seed=seed,
        site_tiers=",".join(TIERS[i % len(TIERS)] for i in range(scale.sites)),
        lora_rank=group.lora_rank,
        lr=group.lr,
    )
    return dataclasses.replace(config, **dict(group.overrides))


def tier_of(node: str) -> str:
    return TIERS[(int(node) - FIRST_NODE_ID) % len(TIERS)]


def per_tier(values: dict[str, int]) -> dict[str, int]:
    """The largest value a site of each tier reported (sites of one tier report the same budget)."""
    out: dict[str, int] = {}
    for node, value in values.items():
        out[tier_of(node)] = max(out.get(tier_of(node), 0), value)
    return out


def summarise(
    history: list[dict[str, Any]], assigned: dict[str, dict[str, int]] | None = None
) -> dict[str, Any]:
    """One run's numbers: final accuracy, mean bytes per training round, per-tier trainable parameters (what
    the strategy assigned, when it assigns budgets: a LoRA site trains its rank of the rank-R factors, which
    it cannot count itself; else what the sites reported) and per-tier peak memory (measured by the sites)."""
    rounds = history[1:]
    params: dict[str, int] = {}
    memory: dict[str, int] = {}
    for record in rounds:
        counts = (assigned or {}).get(str(record["round"]), record["trainable_params_per_site"])
        for tier, value in per_tier(counts).items():
            params[tier] = max(params.get(tier, 0), value)
        for tier, value in per_tier(record["peak_memory_per_site"]).items():
            memory[tier] = max(memory.get(tier, 0), value)
    return {
        "accuracy": history[-1]["accuracy"],
        "bytes_per_round": statistics.mean(r["bytes_up"] + r["bytes_down"] for r in rounds),
        "params": params,
        "peak_memory": memory,
    }


def run(
    groups: dict[str, Group], quick: bool, seeds: int | None, work: Path, first_seed: int = 0
) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in groups}
    for name, group in groups.items():
        scale = group.quick if quick else group.full
        for seed in range(first_seed, first_seed + (seeds or scale.seeds)):
            settings = run_config(group, scale, seed)
            calls: list[tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]] = (
                [(group.strategies, group.strategies, {})] if group.strategies else []
            )
            calls += [((label,), ("hydra",), dict(knobs)) for label, knobs in group.variants]
            for labels, strategies, knobs in calls:
                config = SimulationConfig(
                    run=settings,
                    strategies=strategies,
                    knobs=knobs,
                    out=str(work / f"{name}-seed{seed}-{labels[0]}"),
                )
                results = json.loads(
                    json.dumps(compare_strategies(config))
                )  # JSON keys, as results.json has them
                for label, strategy in zip(labels, strategies, strict=True):
                    done = results["strategies"][strategy]
                    summary = summarise(done["rounds"], done.get("trainable_params_per_site"))
                    runs[name].setdefault(label, []).append({"seed": seed, **summary})
    return runs


def method_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    accuracies = [run["accuracy"] for run in runs]
    return {
        "accuracy_mean": statistics.mean(accuracies),
        "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
        "bytes_per_round": statistics.mean(run["bytes_per_round"] for run in runs),
        "params": runs[0]["params"],
        "peak_memory": {
            tier: max(run["peak_memory"].get(tier, 0) for run in runs) for tier in TIERS
        },
    }


def best_baseline(methods: dict[str, dict[str, Any]]) -> str | None:
    """The heterogeneous baseline with the highest mean accuracy (FedAvg and FedIT are not heterogeneous);
    None when the group has no Hydra to compare or no such baseline."""
    baselines = [
        name
        for name in methods
        if name not in ("hydra", "fedavg", "fedit") and not name.startswith("hydra-")
    ]
    if "hydra" not in methods or not baselines:
        return None
    return max(baselines, key=lambda name: methods[name]["accuracy_mean"])


def goals(stats: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, methods in stats.items():
        if (best := best_baseline(methods)) is not None:
            out[f"{group}: hydra >= best baseline ({best})"] = (
                methods["hydra"]["accuracy_mean"] >= methods[best]["accuracy_mean"]
            )
    (ref_group, ref), (group, method) = BYTES_GOAL
    if ref in stats.get(ref_group, {}) and method in stats.get(group, {}):
        reference, hydra = stats[ref_group][ref], stats[group][method]
        ratio = reference["bytes_per_round"] / hydra["bytes_per_round"]
        gap = 100 * (reference["accuracy_mean"] - hydra["accuracy_mean"])
        out[f"bytes ratio {ref_group} {ref} / {group} {method}"] = ratio
        out[f"accuracy points {group} {method} below {ref_group} {ref}"] = gap
        out[
            f"{group} {method}: >= {GOAL_BYTES_RATIO:g}x fewer bytes within {GOAL_ACCURACY_POINTS:g} point"
        ] = ratio >= GOAL_BYTES_RATIO and gap <= GOAL_ACCURACY_POINTS
    return out


def paired(
    runs: dict[str, dict[str, list[dict[str, Any]]]], stats: dict[str, dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """Per group, Hydra minus the best baseline, and each Hydra variant minus Hydra, in accuracy points over
    the seeds both ran: mean and standard error of the per-seed differences (the seed moves every method
    alike, so pairing removes most spread)."""
    out: dict[str, Any] = {}
    for group, methods in stats.items():
        pairs = [("hydra", best)] if (best := best_baseline(methods)) is not None else []
        if "hydra" in methods:
            pairs += [(name, "hydra") for name in methods if name.startswith("hydra-")]
        for one, other in pairs:
            if (gap := paired_gap(runs[group][one], runs[group][other])) is not None:
                out[f"{group}: {one} - {other}"] = gap
    return out


def paired_gap(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> dict[str, Any] | None:
    """First minus second in accuracy points over the seeds both ran: mean and standard error of the per-seed
    differences; None with fewer than two seeds in common (no spread to report)."""
    one = {run["seed"]: run["accuracy"] for run in first}
    other = {run["seed"]: run["accuracy"] for run in second}
    differences = [100 * (one[seed] - other[seed]) for seed in sorted(one.keys() & other.keys())]
    if len(differences) < 2:
        return None
    return {
        "seeds": len(differences),
        "mean_points": statistics.mean(differences),
        "standard_error_points": statistics.stdev(differences) / math.sqrt(len(differences)),
    }


def merged(
    previous: dict[str, Any] | None, runs: dict[str, Any], scales: dict[str, Any], quick: bool
) -> tuple[dict, dict]:
    """`runs` merged into a previous results file's runs: per group of the same scale and mode, by seed (this
    run's seeds replace the previous ones); a group run at another scale starts afresh; other groups stay."""
    if previous is None or previous.get("quick") != quick:
        return runs, scales
    all_runs, all_scales = dict(previous["runs"]), dict(previous["scales"])

    def shape(scale: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in scale.items() if key != "seeds"}

    for group, methods in runs.items():
        kept = (
            all_runs.get(group, {})
            if group in all_scales and shape(all_scales[group]) == shape(scales[group])
            else {}
        )
        group_runs = {name: list(method_runs) for name, method_runs in kept.items()}
        for name, method_runs in methods.items():
            seeds = {run["seed"] for run in method_runs}
            old = [run for run in group_runs.get(name, []) if run["seed"] not in seeds]
            group_runs[name] = sorted(old + method_runs, key=lambda run: run["seed"])
        all_runs[group] = group_runs
        all_scales[group] = {**scales[group], "seeds": max(len(r) for r in group_runs.values())}
    return all_runs, all_scales


def print_tables(summary: dict[str, Any], groups: dict[str, Group] = GROUPS) -> None:
    console = Console()
    for group, methods in summary["stats"].items():
        scale = summary["scales"][group]
        table = Table(
            title=f"{group} ({groups[group].model}{', LoRA' if groups[group].lora_rank else ''}): "
            f"{len(summary['runs'][group][next(iter(methods))])} seeds, {scale['sites']} sites, "
            f"{scale['rounds']} rounds, tiers {', '.join(TIERS)}"
        )
        for column in ("method", "accuracy", "MB / round", "params s/m/l", "peak MB s/m/l"):
            table.add_column(column, justify="right")
        for name, s in methods.items():
            params = "/".join(f"{s['params'].get(t, 0):,}" for t in TIERS)
            memory = "/".join(f"{s['peak_memory'].get(t, 0) / 1e6:.1f}" for t in TIERS)
            accuracy = f"{s['accuracy_mean']:.3f} ± {s['accuracy_std']:.3f}"
            table.add_row(name, accuracy, f"{s['bytes_per_round'] / 1e6:.2f}", params, memory)
        console.print(table)
    for goal, value in summary["goals"].items():
        console.print(f"{goal}: {verdict(value) if isinstance(value, bool) else f'{value:.2f}'}")
    for pair, value in summary["paired"].items():
        console.print(
            f"{pair}, paired over {value['seeds']} seeds: {value['mean_points']:+.2f} ± "
            f"{value['standard_error_points']:.2f} points (standard error)"
        )


def plot(summary: dict[str, Any], path: Path, budget: str = "equal per-tier budgets") -> None:
    stats = summary["stats"]
    fig, axes = plt.subplots(1, len(stats), figsize=(6 * len(stats), 4.5), squeeze=False)
    for ax, (group, methods) in zip(axes[0], stats.items(), strict=True):
        for name, s in methods.items():
            ax.errorbar(
                s["bytes_per_round"] / 1e6,
                s["accuracy_mean"],
                yerr=s["accuracy_std"],
                fmt="o",
                capsize=4,
                label=name,
            )
        ax.set_xscale("log")
        ax.set_xlabel("MB per round (up + down, all sites)")
        ax.set_ylabel("final accuracy (mean ± sd over seeds)")
        ax.set_title(f"{group}: {budget}")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(
    path: Path,
    runs: dict[str, Any],
    scales: dict[str, Any],
    quick: bool,
    others: tuple[Path, ...] = (),
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`runs` merged into the results file at `path` (and the runs of the `others`, results files of the same
    benchmark that processes splitting the seeds wrote), with the statistics over all of them and `extra`;
    written atomically, so a reader never sees half a file."""
    for source in (path, *others):
        if source.exists():
            runs, scales = merged(json.loads(source.read_text()), runs, scales, quick)
    stats = {
        group: {name: method_stats(r) for name, r in methods.items()}
        for group, methods in runs.items()
    }
    summary = {
        "benchmark": path.stem,
        "quick": quick,
        "scales": scales,
        "runs": runs,
        "stats": stats,
        "goals": goals(stats),
        "paired": paired(runs, stats),
        **(extra or {}),
    }
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(summary, indent=1))
    partial.replace(path)
    return summary


def group_parser(doc: str | None, groups: dict[str, Group]) -> argparse.ArgumentParser:
    """The command line of a benchmark over groups: --out, --quick, --seeds, --first-seed, --groups."""
    parser = benchmark_parser(doc, "1 seed, 1-2 rounds, 3 sites")
    parser.add_argument(
        "--seeds", type=int, default=None, help="seeds per method (default: the group's; quick: 1)"
    )
    parser.add_argument(
        "--first-seed", type=int, default=0, help="the first seed (seeds run from it upward)"
    )
    parser.add_argument(
        "--groups", default=",".join(groups), help=f"which of {', '.join(groups)} to run"
    )
    return parser


def chosen_groups(
    parser: argparse.ArgumentParser, names: str, groups: dict[str, Group]
) -> dict[str, Group]:
    """The groups `--groups` names, in its order; an unknown one is a usage error."""
    picked = [name.strip() for name in names.split(",") if name.strip()]
    unknown = sorted(set(picked) - set(groups))
    if unknown:
        parser.error(f"unknown groups {unknown}; choose from {', '.join(groups)}")
    return {name: groups[name] for name in picked}


def main() -> None:
    parser = group_parser(__doc__, GROUPS)
    args = parser.parse_args()
    groups = chosen_groups(parser, args.groups, GROUPS)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-hetero-") as tmp:
        runs = run(groups, args.quick, args.seeds, Path(tmp), args.first_seed)
    scales = {
        name: dataclasses.asdict(group.quick if args.quick else group.full)
        for name, group in groups.items()
    }
    summary = write_results(args.out / f"{NAME}.json", runs, scales, args.quick)
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
