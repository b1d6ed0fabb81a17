"""Experts of a mixture-of-experts LM: which experts each site trains, at equal per-tier budgets, over seeds.

    python -m hydrafl.benchmarks.moe_experts [--out DIR] [--quick] [--seeds N]

The next-token task (`clinical-notes-lm`, non-IID notes per site) on the seeded tiny Mixtral-family LM
(`--model tiny-moe`: 2 layers, 8 experts per layer, top-2 routing), three sites of tiers small, medium and
large. Methods:
- fedavg: every site trains every expert;
- hydra: each site trains, in every layer, the groups of experts its tokens route to together (co-activation)
  in order of routed share, as many experts as its tier affords (small 2, medium 4, large 8 of 8);
- hydra-routed: the same budget, the most-routed experts one by one (no co-activation);
- hydra-random: the same budget, experts drawn at random each round.
Experts a site does not train still run in its forward pass (frozen), so every site downloads the whole model;
it uploads only its experts' rows. Reported per method (mean and sd over seeds): final token accuracy and loss,
bytes per training round (up + down, all sites; upload alone too) and per-tier peak training memory.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from hydrafl.benchmarks._common import benchmark_parser
from hydrafl.benchmarks.heterogeneous import TIERS, per_tier
from hydrafl.config import RunConfig
from hydrafl.simulation.compare import compare_strategies
from hydrafl.simulation_config import SimulationConfig

NAME = "moe_experts"
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("fedavg", {}),
    "hydra": ("hydra", {"expert_select": "coactivation"}),
    "hydra-routed": ("hydra", {"expert_select": "routed"}),
    "hydra-random": ("hydra", {"expert_select": "random"}),
}
"""Method name -> (strategy, its knobs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Scale:
    rounds: int
    local_steps: int
    seeds: int


FULL, QUICK = Scale(rounds=6, local_steps=6, seeds=3), Scale(rounds=1, local_steps=1, seeds=1)


def run_config(scale: Scale, seed: int) -> RunConfig:
    return RunConfig(
        task="clinical-notes-lm",
        model="tiny-moe",
        sites=len(TIERS),
        rounds=scale.rounds,
        local_steps=scale.local_steps,
        seed=seed,
        site_tiers=",".join(TIERS),
    )


def summarise(history: list[dict[str, Any]]) -> dict[str, Any]:
    """One run: final token accuracy and loss, mean bytes per training round, per-tier peak memory."""
    rounds = history[1:]  # round 0 is the initial evaluation
    memory: dict[str, int] = {}
    for record in rounds:
        for tier, value in per_tier(record["peak_memory_per_site"]).items():
            memory[tier] = max(memory.get(tier, 0), value)
    return {
        "accuracy": history[-1]["accuracy"],
        "loss": history[-1]["loss"],
        "bytes_per_round": statistics.mean(r["bytes_up"] + r["bytes_down"] for r in rounds),
        "bytes_up_per_round": statistics.mean(r["bytes_up"] for r in rounds),
        "peak_memory": memory,
    }


def run(scale: Scale, seeds: int, work: Path) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in METHODS}
    for seed in range(seeds):
        for name, (strategy, knobs) in METHODS.items():
            config = SimulationConfig(
                run=run_config(scale, seed),
                strategies=(strategy,),
                knobs=knobs,
                out=str(work / f"{name}-seed{seed}"),
            )
            results = json.loads(json.dumps(compare_strategies(config)))
            history = results["strategies"][strategy]["rounds"]
            runs[name].append({"seed": seed, **summarise(history)})
    return runs


def method_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(key: str) -> tuple[float, float]:
        values = [run[key] for run in runs]
        return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0

    (acc, acc_sd), (loss, loss_sd) = spread("accuracy"), spread("loss")
    return {
        "accuracy_mean": acc,
        "accuracy_std": acc_sd,
        "loss_mean": loss,
        "loss_std": loss_sd,
        "bytes_per_round": statistics.mean(run["bytes_per_round"] for run in runs),
        "bytes_up_per_round": statistics.mean(run["bytes_up_per_round"] for run in runs),
        "peak_memory": {
            tier: max(run["peak_memory"].get(tier, 0) for run in runs) for tier in TIERS
        },
    }


def paired(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Hydra's token accuracy minus each other method's, paired by seed: mean and standard error, in points."""
    out = {}
    for name in runs:
        if name == "hydra":
            continue
        diffs = [
            100 * (a["accuracy"] - b["accuracy"])
            for a, b in zip(runs["hydra"], runs[name], strict=True)
        ]
        error = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
        out[f"hydra - {name}"] = {"mean_points": statistics.mean(diffs), "standard_error": error}
    return out


def markdown(summary: dict[str, Any], command: str) -> str:
    lines = [
        f"# Experts of a mixture-of-experts LM ({'quick' if summary['quick'] else 'full'})",
        "",
        f"`{command}`; scale {summary['scale']}. Mean ± sd over seeds.",
        "",
        "| method | token accuracy | loss | MB / round (up + down) | MB up / round | peak MB s/m/l |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in summary["stats"].items():
        memory = "/".join(f"{s['peak_memory'].get(t, 0) / 1e6:.1f}" for t in TIERS)
        lines.append(
            f"| {name} | {s['accuracy_mean']:.4f} ± {s['accuracy_std']:.4f} "
            f"| {s['loss_mean']:.4f} ± {s['loss_std']:.4f} | {s['bytes_per_round'] / 1e6:.2f} "
            f"| {s['bytes_up_per_round'] / 1e6:.2f} | {memory} |"
        )
    lines.append("")
    for pair, value in summary["paired"].items():
        lines.append(
            f"- {pair}, paired by seed: {value['mean_points']:+.2f} ± "
            f"{value['standard_error']:.2f} points (standard error)"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    """Bars per method: final token accuracy (sd over seeds) and MB uploaded per round."""
    names, stats = list(summary["stats"]), list(summary["stats"].values())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(names, [s["accuracy_mean"] for s in stats], yerr=[s["accuracy_std"] for s in stats])
    left.set_ylabel("final token accuracy (mean ± sd over seeds)")
    right.bar(names, [s["bytes_up_per_round"] / 1e6 for s in stats])
    right.set_ylabel("MB uploaded per round (all sites)")
    fig.suptitle("tiny-moe: expert selection at equal per-tier budgets")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = benchmark_parser(__doc__, "1 seed, 1 round of 1 local step")
    parser.add_argument("--seeds", type=int, default=None, help="seeds (default 3, quick 1)")
    args = parser.parse_args()
    scale = QUICK if args.quick else FULL
    seeds = args.seeds or scale.seeds
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hydrafl-moe-") as tmp:
        runs = run(scale, seeds, Path(tmp))
    summary = {
        "benchmark": NAME,
        "quick": args.quick,
        "scale": {"rounds": scale.rounds, "local_steps": scale.local_steps, "seeds": seeds},
        "runs": runs,
        "stats": {name: method_stats(r) for name, r in runs.items()},
        "paired": paired(runs),
    }
    (args.out / f"{NAME}.json").write_text(json.dumps(summary, indent=1))
    command = "python -m hydrafl.benchmarks.moe_experts" + (" --quick" if args.quick else "")
    (args.out / f"{NAME}.md").write_text(markdown(summary, command))
    plot(summary, args.out / f"{NAME}.png")
    table = Table(title=f"{NAME}: equal per-tier expert budgets")
    for column in ("method", "token accuracy", "loss", "MB / round", "MB up", "peak MB s/m/l"):
        table.add_column(column)
    for name, s in summary["stats"].items():
        table.add_row(
            name,
            f"{s['accuracy_mean']:.4f} ± {s['accuracy_std']:.4f}",
            f"{s['loss_mean']:.4f}",
            f"{s['bytes_per_round'] / 1e6:.2f}",
            f"{s['bytes_up_per_round'] / 1e6:.2f}",
            "/".join(f"{s['peak_memory'].get(t, 0) / 1e6:.1f}" for t in TIERS),
        )
    Console().print(table)


if __name__ == "__main__":
    main()
