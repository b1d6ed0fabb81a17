"""Hydra vs the model-heterogeneous baselines at equal per-site budgets, over several seeds.

    python -m hydrafl.benchmarks.heterogeneous [--out DIR] [--quick] [--seeds N]

Non-IID hospitals (the clinical-text cohort: per-site label prevalence and writing style) with three resource
tiers (small, medium, large, cycling over the sites). Every heterogeneous method gives a site of a tier the
same budget in trainable parameters (Hydra's layers x heads for the tier; the width baselines pick the width,
the LoRA baselines the rank, that comes closest), and every method runs the same seeds, data and rounds.

Two groups, because the coordinates differ:
- full model: FedAvg (every site trains everything), Hydra, HeteroFL, FjORD, FedRolex;
- LoRA (rank `LORA_RANK` on the attention projections, the classifier head trained too): FedIT, Hydra,
  FLoRA, HetLoRA, FlexLoRA.

Reported per method: final accuracy (mean and standard deviation over seeds), bytes per round (up + down, all
sites), per-tier trainable parameters and per-tier peak training memory as the sites measured them
(`hydrafl.footprint`). Goals (from the issue): Hydra at or above the best heterogeneous baseline of its group;
Hydra (LoRA) at >= 10x fewer bytes per round than full-model FedAvg within 1 accuracy point of it.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from hydrafl.benchmarks._common import benchmark_parser, verdict  # noqa: E402
from hydrafl.config import RunConfig, SimulationConfig  # noqa: E402
from hydrafl.simulation.compare import compare_strategies  # noqa: E402
from hydrafl.simulation.grid import FIRST_NODE_ID  # noqa: E402

NAME = "heterogeneous"
TIERS = ("small", "medium", "large")
LORA_RANK = 8
GROUPS = {
    "full": ("fedavg", "hydra", "heterofl", "fjord", "fedrolex"),
    "lora": ("fedit", "hydra", "flora", "hetlora", "flexlora"),
}
REFERENCE = ("full", "fedavg")
GOAL_BYTES_RATIO = 10.0
GOAL_ACCURACY_POINTS = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    sites: int
    rounds: int
    local_steps: int
    seeds: int


FULL = Scale(sites=6, rounds=12, local_steps=10, seeds=3)
QUICK = Scale(sites=3, rounds=2, local_steps=2, seeds=1)


def run_config(scale: Scale, group: str, seed: int) -> RunConfig:
    return RunConfig(
        task="clinical-text",
        sites=scale.sites,
        rounds=scale.rounds,
        local_steps=scale.local_steps,
        seed=seed,
        site_tiers=",".join(TIERS[i % len(TIERS)] for i in range(scale.sites)),
        lora_rank=LORA_RANK if group == "lora" else 0,
    )


def tier_of(node: str) -> str:
    return TIERS[(int(node) - FIRST_NODE_ID) % len(TIERS)]


def per_tier(values: dict[str, int]) -> dict[str, int]:
    """The largest value a site of each tier reported (sites of one tier report the same budget)."""
    out: dict[str, int] = {}
    for node, value in values.items():
        out[tier_of(node)] = max(out.get(tier_of(node), 0), value)
    return out


def summarise(history: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's numbers: final accuracy, mean bytes per training round, per-tier params and peak memory."""
    rounds = history[1:]
    params: dict[str, int] = {}
    memory: dict[str, int] = {}
    for record in rounds:
        for tier, value in per_tier(record["trainable_params_per_site"]).items():
            params[tier] = max(params.get(tier, 0), value)
        for tier, value in per_tier(record["peak_memory_per_site"]).items():
            memory[tier] = max(memory.get(tier, 0), value)
    return {
        "accuracy": history[-1]["accuracy"],
        "bytes_per_round": statistics.mean(r["bytes_up"] + r["bytes_down"] for r in rounds),
        "params": params,
        "peak_memory": memory,
    }


def run(scale: Scale, work: Path) -> dict[str, Any]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {group: {} for group in GROUPS}
    for seed in range(scale.seeds):
        for group, strategies in GROUPS.items():
            config = SimulationConfig(
                run=run_config(scale, group, seed), strategies=strategies, out=str(work / f"{group}-seed{seed}")
            )
            results = compare_strategies(config)
            for strategy in strategies:
                summary = summarise(results["strategies"][strategy]["rounds"])
                runs[group].setdefault(strategy, []).append({"seed": seed, **summary})
    return runs


def method_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    accuracies = [run["accuracy"] for run in runs]
    return {
        "accuracy_mean": statistics.mean(accuracies),
        "accuracy_std": statistics.stdev(accuracies) if len(accuracies) > 1 else 0.0,
        "bytes_per_round": statistics.mean(run["bytes_per_round"] for run in runs),
        "params": runs[0]["params"],
        "peak_memory": {tier: max(run["peak_memory"].get(tier, 0) for run in runs) for tier in TIERS},
    }


def goals(stats: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for group, methods in stats.items():
        baselines = {name: s for name, s in methods.items() if name not in ("hydra", "fedavg", "fedit")}
        best = max(baselines, key=lambda name: baselines[name]["accuracy_mean"])
        out[f"{group}: hydra >= best baseline ({best})"] = (
            methods["hydra"]["accuracy_mean"] >= baselines[best]["accuracy_mean"]
        )
    fedavg = stats[REFERENCE[0]][REFERENCE[1]]
    hydra = stats["lora"]["hydra"]
    ratio = fedavg["bytes_per_round"] / hydra["bytes_per_round"]
    gap = 100 * (fedavg["accuracy_mean"] - hydra["accuracy_mean"])
    out["bytes ratio fedavg / hydra (lora)"] = ratio
    out["accuracy points hydra (lora) below fedavg"] = gap
    out[f"hydra (lora): >= {GOAL_BYTES_RATIO:g}x fewer bytes within {GOAL_ACCURACY_POINTS:g} point"] = (
        ratio >= GOAL_BYTES_RATIO and gap <= GOAL_ACCURACY_POINTS
    )
    return out


def print_tables(summary: dict[str, Any]) -> None:
    console = Console()
    for group, methods in summary["stats"].items():
        table = Table(title=f"{group}: {summary['scale']['seeds']} seeds, {summary['scale']['sites']} sites, "
                            f"{summary['scale']['rounds']} rounds, tiers {', '.join(TIERS)}")
        for column in ("method", "accuracy", "MB / round", "params s/m/l", "peak MB s/m/l"):
            table.add_column(column, justify="right")
        for name, s in methods.items():
            params = "/".join(f"{s['params'].get(t, 0):,}" for t in TIERS)
            memory = "/".join(f"{s['peak_memory'].get(t, 0) / 1e6:.1f}" for t in TIERS)
            accuracy = f"{s['accuracy_mean']:.3f} ± {s['accuracy_std']:.3f}"
            table.add_row(name, accuracy, f"{s['bytes_per_round'] / 1e6:.2f}", params, memory)
        console.print(table)
    for goal, value in summary["goals"].items():
        if isinstance(value, bool):
            console.print(f"{goal}: {verdict(value)}")
        else:
            console.print(f"{goal}: {value:.2f}")


def plot(summary: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(1, len(summary["stats"]), figsize=(6 * len(summary["stats"]), 4.5), squeeze=False)
    for ax, (group, methods) in zip(axes[0], summary["stats"].items(), strict=True):
        for name, s in methods.items():
            ax.errorbar(s["bytes_per_round"] / 1e6, s["accuracy_mean"], yerr=s["accuracy_std"], fmt="o", capsize=4,
                        label=name)
        if group != REFERENCE[0]:
            fedavg = summary["stats"][REFERENCE[0]][REFERENCE[1]]
            ax.errorbar(fedavg["bytes_per_round"] / 1e6, fedavg["accuracy_mean"], yerr=fedavg["accuracy_std"],
                        fmt="s", color="gray", capsize=4, label="fedavg (full model)")
        ax.set_xscale("log")
        ax.set_xlabel("MB per round (up + down, all sites)")
        ax.set_ylabel("final accuracy (mean ± sd over seeds)")
        ax.set_title(f"{group}: equal per-tier budgets")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, str(QUICK))
    parser.add_argument("--seeds", type=int, default=None, help="seeds per method (default: 3, quick: 1)")
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    if args.seeds:
        scale = dataclasses.replace(scale, seeds=args.seeds)
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-hetero-") as tmp:
        runs = run(scale, Path(tmp))
    stats = {group: {name: method_stats(r) for name, r in methods.items()} for group, methods in runs.items()}
    summary = {"benchmark": NAME, "quick": args.quick, "scale": dataclasses.asdict(scale), "runs": runs,
               "stats": stats, "goals": goals(stats)}
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    plot(summary, args.out / f"{NAME}.png")
    print_tables(summary)


if __name__ == "__main__":
    main()
